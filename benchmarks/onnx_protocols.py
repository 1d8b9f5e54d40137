"""An ONNX model in a Triton repository served by carpool, over HTTP and over gRPC,
against the same model in onnxruntime in this process: the single call (c=1 latency)
and the batched ceiling (rows/s at batch 64, the most a server could reach). Served:
c=1 median latency per protocol (tritonclient.http and tritonclient.grpc, one request
at a time; beside it the same client's bare round trip, ``is_server_live``, the part of
the overhead that is the client library's and the transport's) and c=64 throughput
(tritonclient's asyncio clients, 64 requests in flight, ``--rows`` rows each). Beside
them, the floor of a gRPC call here: the same round trip against grpcio's asyncio
server doing nothing else (``benchmarks.grpc_floor``). Rounds alternate the protocols
so drift falls on both.

    python -m benchmarks.onnx_protocols --hidden 1024 --rounds 3
    python -m benchmarks.onnx_protocols --model cnn --image 224 --rounds 3

The MLP (512 -> hidden -> hidden -> 512, ReLU; a row is 2 KiB) or a small CNN (two
3x3 stride-2 convolutions, ``--hidden`` and twice as many channels, global average pool,
10 classes; a row is a 3 x image x image float32 picture, 588 KiB at 224) is built here
with onnx's helper. Client and server share this machine's cores: at c=64 the clients'
own CPU counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio

from carpool.testing import spawn
from tests.repository_models.tensor_models import mlp_weights, onnx_cnn, onnx_mlp

IN, OUT = 512, 512
CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 64
dynamic_batching { }
"""


@dataclass(frozen=True)
class Served:
    """The model served as ``mlp`` (whichever it is), and the shape of one input row."""

    label: str
    row: tuple[int, ...]
    path: Path


def build(root: Path, kind: str, hidden: int, image: int) -> Served:
    path = root / "mlp" / "1" / "model.onnx"
    (root / "mlp").mkdir(parents=True)
    (root / "mlp" / "config.pbtxt").write_text(CONFIG)
    if kind == "cnn":
        onnx_cnn(path, hidden)
        label = f"ONNX CNN 3x{image}x{image} -> conv {hidden} -> conv {2 * hidden} -> 10"
        return Served(label, (3, image, image), path)
    onnx_mlp(path, mlp_weights((IN, hidden, hidden, OUT)))
    return Served(f"ONNX MLP {IN}->{hidden}->{hidden}->{OUT}", (IN,), path)


def in_process(served: Served, seconds: float) -> tuple[float, float]:
    """(median ms of one row alone, rows/s at batch 64) in onnxruntime here, with the
    intra-op threads carpool gives it (torch's count)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(served.path), options, providers=["CPUExecutionProvider"])
    one = np.random.default_rng(0).standard_normal((1, *served.row)).astype(np.float32)
    batch = np.repeat(one, 64, axis=0)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        session.run(["y"], {"x": one})
        times.append(time.perf_counter() - started)
    rows = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(["y"], {"x": batch})
        rows += 64
    return statistics.median(times) * 1e3, rows / (time.perf_counter() - started)


def floor_trip(url: str, count: int) -> float:
    """Median ms of ``count`` bare round trips to the do-nothing grpcio server."""
    client = tgrpc.InferenceServerClient(url)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        client.is_server_live()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def single(
    http_url: str, grpc_url: str, protocol: str, row: tuple[int, ...], count: int
) -> tuple[float, float]:
    """Median ms of ``count`` one-row requests, one at a time, and of as many bare
    round trips of the same client (``is_server_live``: its transport alone)."""
    x = np.random.default_rng(1).standard_normal((1, *row)).astype(np.float32)
    module: Any = thttp if protocol == "http" else tgrpc
    client = module.InferenceServerClient(http_url if protocol == "http" else grpc_url)
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, **({"binary_data": True} if protocol == "http" else {}))
    outputs = [
        module.InferRequestedOutput("y", **({"binary_data": True} if protocol == "http" else {}))
    ]
    times, bare = [], []
    for _ in range(count):
        started = time.perf_counter()
        client.infer("mlp", [tensor], outputs=outputs)
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        client.is_server_live()
        bare.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, statistics.median(bare) * 1e3


async def many(
    urls: tuple[str, str], protocol: str, row: tuple[int, ...], load: tuple[int, float, int]
) -> tuple[float, float]:
    """Rows/s with ``concurrency`` requests of ``rows`` rows in flight for ``seconds``
    (``load``), and the cores this (client) process used meanwhile."""
    concurrency, seconds, rows = load
    x = np.random.default_rng(2).standard_normal((rows, *row)).astype(np.float32)
    module: Any = thttp_aio if protocol == "http" else tgrpc_aio
    client = module.InferenceServerClient(urls[0] if protocol == "http" else urls[1])
    tensor = module.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, **({"binary_data": True} if protocol == "http" else {}))
    outputs = [
        module.InferRequestedOutput("y", **({"binary_data": True} if protocol == "http" else {}))
    ]
    done = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await client.infer("mlp", [tensor], outputs=outputs)
            done += rows

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    cores = (time.process_time() - cpu) / elapsed
    await client.close()
    return done / elapsed, cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument(
        "--hidden", type=int, default=1024, help="the MLP's width; the CNN's first channels"
    )
    parser.add_argument("--image", type=int, default=224, help="the CNN's picture side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--rows", type=int, default=1, help="rows per request at the concurrency (c=1: one)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    served = build(root, args.model, args.hidden, args.image)
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--grpc-port",
               "-1", "--model-repository", str(root)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ready = re.compile(r"carpool ready on http://(\S+) .*gRPC on (\S+)")
    process, match, _ = spawn(command, ready, 300.0, env)
    http_url, grpc_url = match.group(1), match.group(2)
    floor_command = [sys.executable, "-m", "benchmarks.grpc_floor"]
    floor, floor_match, _ = spawn(floor_command, re.compile(r"floor on (\S+)"), 60.0, env)
    results: dict[str, list[float]] = {}
    try:
        for _ in range(args.rounds):
            floor_ms = floor_trip(floor_match.group(1), 300)
            results.setdefault("grpcio floor round trip ms", []).append(floor_ms)
            alone, ceiling = in_process(served, args.seconds)
            results.setdefault("in-process c=1 ms", []).append(alone)
            results.setdefault("in-process batch-64 rows/s", []).append(ceiling)
            for protocol in ("http", "grpc"):
                ms, bare = single(http_url, grpc_url, protocol, served.row, 300)
                results.setdefault(f"{protocol} bare round trip ms", []).append(bare)
                load = (args.concurrency, args.seconds, args.rows)
                rate, cores = asyncio.run(many((http_url, grpc_url), protocol, served.row, load))
                results.setdefault(f"{protocol} client cores", []).append(cores)
                results.setdefault(f"{protocol} c=1 ms", []).append(ms)
                results.setdefault(f"{protocol} c={args.concurrency} rows/s", []).append(rate)
    finally:
        process.send_signal(signal.SIGTERM)
        floor.kill()
        process.wait(60)
        floor.wait(60)
    print(f"{served.label}, torch threads "
          f"{torch.get_num_threads()}, {args.rounds} rounds of {args.seconds:g}s, "
          f"{args.rows} rows a request at c={args.concurrency}")  # fmt: skip
    for name, values in results.items():
        shown = ", ".join(f"{v:.3g}" for v in values)
        print(f"  {name:28} median {statistics.median(values):9.4g}   ({shown})")
    ceiling = statistics.median(results["in-process batch-64 rows/s"])
    alone = statistics.median(results["in-process c=1 ms"])
    for protocol in ("http", "grpc"):
        rate = statistics.median(results[f"{protocol} c={args.concurrency} rows/s"])
        ms = statistics.median(results[f"{protocol} c=1 ms"])
        bare = statistics.median(results[f"{protocol} bare round trip ms"])
        rest = ms - alone - bare
        print(f"  {protocol}: c={args.concurrency} {rate / ceiling:.2f}x the ceiling; "
              f"c=1 overhead {ms - alone:.3f} ms over the in-process call, of which the "
              f"client's bare round trip {bare:.3f} ms and the rest {rest:.3f} ms")  # fmt: skip
    print("reproduce: python -m benchmarks.onnx_protocols " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
