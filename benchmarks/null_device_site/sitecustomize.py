"""Run at the start of every Python process whose path holds this folder (the server
``benchmarks.null_http`` starts, and the engine process that server spawns): with
``CARPOOL_BENCH_NULL_DEVICE_MS`` set, every generation engine built in the process
drives the null device of ``benchmarks.null_device`` instead of the model."""

import os

if "CARPOOL_BENCH_NULL_DEVICE_MS" in os.environ:
    from benchmarks.null_http import install_null_device

    install_null_device(float(os.environ["CARPOOL_BENCH_NULL_DEVICE_MS"]))
