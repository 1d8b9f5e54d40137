"""The stream delivery path with a null device (issue 48, item 3): what a streamed
token costs the server beyond what it costs the engine.

The same null device as ``benchmarks.null_device`` (the real ``Engine``; a runner that
answers common words and takes ``--device-ms`` a step; with ``--async-scheduling``, a
GPU's default, steps are launched onto its timeline and landed later) runs twice on one workload
(``--requests``, 128 tokens each, EOS ignored, ``--concurrency`` at a time; by default
one wave, whose time over HTTP includes the 64 streams' start and end): offline, the
engine stepped in this process; then behind a real ``carpool serve`` (the built-in
model's server with its engine's runner swapped for the null one: FastAPI, the
OpenAI completions route, SSE) driven by streaming clients at that concurrency.
Printed for each: tokens/s, and the server's CPU time per token (the engine's host
time alone offline; the whole server process over HTTP, from /proc), so the HTTP
path's own cost per token is their difference, steadier than the rates on a shared
CPU; and the clients' CPU time per token (they run on the same cores).

The swap is made by ``null_device_site/sitecustomize.py``, which every Python process
started with that folder on its path runs first: the server's, and with
``--engine-process`` (the GPU default) its engine's process too, whose CPU time then
counts as the server's.

    python -m benchmarks.null_http [--device-ms 0 2] [--concurrency 64] [--requests N] [--rounds 2]
                                   [--client-processes 1] [--engine-process] [--async-scheduling]
                                   [--model FOLDER] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.null_device import NullRunner, builtin_tokenizer
from benchmarks.proc_cpu import tree_cpu_s
from benchmarks.stream_loadgen import run_streams_split
from benchmarks.workload import token_prompts

MODEL = "smollm2-135m-instruct"
TOKENS = 128
ROOT = str(Path(__file__).resolve().parents[1])
SITE = str(Path(__file__).resolve().parent / "null_device_site")  # its sitecustomize
READY = re.compile(r"carpool ready on (http://\S+)")


def install_null_device(device_ms: float) -> None:
    """Every generation engine this process builds from now on (``carpool serve``'s,
    in its process or in an engine process) gets the null device as its runner."""
    from carpool.engine.engine import Engine
    from carpool.server import bootstrap

    def null_engine(lm: Any, config: Any, **_: Any) -> Engine:
        return Engine(NullRunner(lm.tokenizer, device_ms / 1000, num_blocks=8192), config)

    bootstrap.engine_for = null_engine  # type: ignore[assignment]


def offline(
    device_ms: float,
    concurrency: int,
    requests: int,
    tokenizer_dir: str | None,
    async_scheduling: bool,
) -> tuple[float, float]:
    """The engine alone (``requests`` added at once, ``concurrency`` running at a time):
    tokens/s and its host CPU microseconds a token."""
    from carpool.config import EngineConfig
    from carpool.engine.engine import Engine
    from carpool.engine.sampling_params import SamplingParams

    tokenizer = builtin_tokenizer(tokenizer_dir)
    runner = NullRunner(tokenizer, device_ms / 1000, num_blocks=8192)
    config = EngineConfig(
        max_num_seqs=concurrency, kv_cache_memory="1GiB", async_scheduling=async_scheduling
    )
    engine = Engine(runner, config)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
    for i, prompt in enumerate(token_prompts(requests, 32, 256, len(tokenizer), seed=3)):
        engine.add_request(f"r{i}", prompt, params)
    started, cpu = time.perf_counter(), time.process_time()
    while engine.has_work:
        engine.step()
    seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    tokens = requests * TOKENS
    return tokens / seconds, cpu_s / tokens * 1e6


def over_http(
    device_ms: float,
    concurrency: int,
    requests: int,
    clients: int,
    engine_process: bool,
    async_scheduling: bool,
    model: str,
) -> tuple[float, float, float]:
    """The same workload streamed through the server (its engine in the server's
    process or in its own), ``concurrency`` streams at a time: tokens/s, the
    server's CPU microseconds a token (the engine process's included) and the
    clients' (on the same cores: what they take, the server cannot have)."""
    from carpool.testing import spawn

    command = [
        sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--grpc-port", "0",
        "--model", model, "--served-model-name", MODEL, "--device", "cpu",
        "--max-num-seqs", str(concurrency), "--kv-cache-memory", "256MiB",
        "--engine-process" if engine_process else "--no-engine-process",
        "--async-scheduling" if async_scheduling else "--no-async-scheduling",
    ]  # fmt: skip
    path = os.pathsep.join([SITE, ROOT, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "CARPOOL_BENCH_NULL_DEVICE_MS": str(device_ms)}
    process, match, _ = spawn(command, READY, 300.0, env)
    try:
        vocab = 49152
        workload = [(p, TOKENS) for p in token_prompts(requests, 32, 256, vocab, seed=3)]
        before = tree_cpu_s(process.pid)
        result = run_streams_split(match.group(1), MODEL, workload, concurrency, clients)
        cpu_s = tree_cpu_s(process.pid) - before
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    tokens = result.completed * TOKENS
    if result.failed:
        sys.exit(f"{result.failed} requests failed")
    per_token = 1e6 / max(1, tokens)
    return result.tokens_per_s, cpu_s * per_token, result.client_cpu_s * per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device-ms", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests in all (0: as many as --concurrency, one wave); more makes "
        "steady state: slots refill as streams end, over HTTP and offline alike",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument(
        "--model",
        default=MODEL,
        help="what the server loads before its runner is swapped: the built-in, or a "
        "folder (benchmarks.real_size's) where the built-in's file is not at hand",
    )
    parser.add_argument("--tokenizer", default=None, help="the built-in's tokenizer folder")
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="the server's engine in its own process (the GPU default)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="each step launched before the last one's tokens are back, offline and over "
        "HTTP alike (the GPU default): the host's work overlaps the null device's time",
    )
    args = parser.parse_args()
    requests = args.requests or args.concurrency
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    for device_ms in args.device_ms:
        rows: dict[str, list[tuple[float, float]]] = {"offline": [], "http": []}
        client_cpu: list[float] = []
        for _ in range(args.rounds):  # interleaved: this CPU drifts within minutes
            rows["offline"].append(
                offline(
                    device_ms, args.concurrency, requests, args.tokenizer, args.async_scheduling
                )
            )
            rate, server_cpu, clients = over_http(
                device_ms,
                args.concurrency,
                requests,
                args.client_processes,
                args.engine_process,
                args.async_scheduling,
                args.model,
            )
            rows["http"].append((rate, server_cpu))
            client_cpu.append(clients)
        for name, runs in rows.items():
            rates = ", ".join(f"{r:.0f}" for r, _ in runs)
            cpu = ", ".join(f"{c:.1f}" for _, c in runs)
            print(
                f"device {device_ms:g} ms  c={args.concurrency}  {name:8} tok/s "
                f"{statistics.median(r for r, _ in runs):8.0f} ({rates})  server CPU us a token "
                f"{statistics.median(c for _, c in runs):6.1f} ({cpu})"
            )
        ratio = statistics.median(r for r, _ in rows["http"]) / statistics.median(
            r for r, _ in rows["offline"]
        )
        print(
            f"device {device_ms:g} ms  c={args.concurrency}  clients' CPU us a token "
            f"{statistics.median(client_cpu):6.1f} ({', '.join(f'{c:.1f}' for c in client_cpu)})"
        )
        print(f"device {device_ms:g} ms  c={args.concurrency}  http / offline {ratio:.2f}x")
    print("reproduce: python -m benchmarks.null_http " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
