"""Serving generation over HTTP, in one run: carpool vs the naive one-at-a-time
server (Hugging Face's "pipelines for a webserver" shape), streaming 128 new
tokens per request at concurrency 1, 16 and 64; plus the offline engine's
inter-token latency for one stream, the reference for carpool at concurrency 1.

    python -m benchmarks.serving [--requests 64] [--naive-requests 8] [--model FOLDER]
                                 [--client-processes 4]

The naive server runs requests one after another, so its throughput does not
depend on the concurrency; it gets ``--naive-requests`` per level to bound the
run. carpool at concurrency 1 gets ``--single-requests``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import re
import signal
import statistics
import sys
import time

import torch

from benchmarks.generation import vocab_of
from benchmarks.proc_cpu import children, process_cpu_s, thread_cpu_s
from benchmarks.stream_loadgen import StreamResult, run_streams, run_streams_split
from benchmarks.workload import token_prompts
from carpool.bench.metrics import percentile
from carpool.testing import free_port, spawn

MODEL = "smollm2-135m-instruct"


def offline_itl(device: str, model: str, engine_args: dict[str, object]) -> float:
    """Median time between a lone request's tokens in the offline engine."""
    from carpool import LLM, SamplingParams

    llm = LLM(model, device=device, **engine_args)  # type: ignore[arg-type]
    engine = llm.engine
    prompt = token_prompts(1, 128, 128, vocab_of(model), seed=5)[0]
    engine.add_request(
        "itl", prompt, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    )
    times = []
    while engine.has_work:
        for out in engine.step():
            if out.outputs[0].new_token_ids:
                times.append(time.perf_counter())
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def serve(command: list[str], ready: str) -> tuple[object, str]:
    process, match, _ = spawn(command, re.compile(ready), 300.0, {**os.environ})
    return process, match.group(1) if match.groups() else ""


ENGINE_COUNTERS = (
    "carpool_engine_steps_total",
    "carpool_engine_prompt_steps_total",
    "carpool_generation_tokens_total",
    # the engine's own view of a request's time (means from sum and count)
    "carpool_time_to_first_token_seconds_sum",
    "carpool_time_to_first_token_seconds_count",
    "carpool_request_queue_time_seconds_sum",
    "carpool_request_queue_time_seconds_count",
)


def engine_counters(url: str, pid: int) -> dict[str, float]:
    """The server's engine counters (summed over models) from its /metrics, and the
    CPU seconds so far of the server's main thread (``main_cpu``: its event loop), its
    other threads (``threads_cpu``) and its child processes (``children_cpu``: an
    engine process), from /proc."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    threads = thread_cpu_s(pid)
    totals["main_cpu"] = threads.pop(pid)
    totals["threads_cpu"] = sum(threads.values())
    totals["children_cpu"] = sum(process_cpu_s(c) for c in children(pid))
    return totals


def engine_row(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """What the engine did between two scrapes: steps, those with a prompt chunk (which
    run eagerly on a GPU: no CUDA graph), tokens generated a step (below the
    concurrency: the batch was not kept full), the engine's own mean time to first
    token and queue time (the client's TTFT less these is the server's and the
    pipe's), and the server's CPU as a share of ``seconds`` (the streams' span)."""
    d = {k: after[k] - before[k] for k in after}
    steps = max(1.0, d["carpool_engine_steps_total"])
    prompt_steps = d["carpool_engine_prompt_steps_total"]

    def mean_ms(name: str) -> float:
        return 1000 * d[f"{name}_sum"] / max(1.0, d[f"{name}_count"])

    return (
        f"{'':10} engine: {steps:.0f} steps, {prompt_steps:.0f} with a prompt chunk "
        f"({prompt_steps / steps:.0%}), {d['carpool_generation_tokens_total'] / steps:.1f} "
        f"tokens generated a step; its TTFT mean "
        f"{mean_ms('carpool_time_to_first_token_seconds'):.0f} ms, queue mean "
        f"{mean_ms('carpool_request_queue_time_seconds'):.0f} ms\n"
        f"{'':10} server CPU over the run: event loop thread {d['main_cpu'] / seconds:.0%}, "
        f"other threads {d['threads_cpu'] / seconds:.0%}, engine process "
        f"{d['children_cpu'] / seconds:.0%}"
    )


def row(name: str, r: StreamResult) -> str:
    return (
        f"{name:10} c={r.concurrency:<3} {r.completed:3d}/{r.requests:<3} ok "
        f"{r.tokens_per_s:7.1f} tok/s  TTFT p50 {percentile(r.ttft_s, 50):6.2f}s "
        f"p99 {percentile(r.ttft_s, 99):6.2f}s  ITL p50 {percentile(r.itl_s, 50) * 1000:6.0f}ms "
        f"p99 {percentile(r.itl_s, 99) * 1000:6.0f}ms  client CPU "
        f"{r.client_cpu_s / r.seconds if r.seconds else 0:4.0%}"
    )


def run_naive(
    args: argparse.Namespace,
    workloads: dict[int, list[tuple[list[int], int]]],
    results: dict[tuple[str, int], StreamResult],
) -> None:
    """The naive one-at-a-time server at each level, into ``results``."""
    port = free_port()
    naive = [sys.executable, "-m", "benchmarks.naive_generation_server", "--port", str(port)]
    process, _ = serve(naive, r"(Uvicorn running|Application startup complete)")
    try:
        for c in args.concurrency:
            load = workloads[c][: args.naive_requests]
            results[("naive", c)] = asyncio.run(
                run_streams(f"http://127.0.0.1:{port}", MODEL, load, min(c, len(load)))
            )
            results[("naive", c)].concurrency = c
            print(row("naive", results[("naive", c)]), flush=True)
    finally:
        process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        process.wait(60)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=8)
    parser.add_argument("--naive-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each level's measured run, one of as many requests as its "
        "concurrency (other prompts), not counted: kernels compiled, pools grown",
    )
    parser.add_argument("--carpool-args", default="", help="extra `carpool serve` flags")
    parser.add_argument("--device", default="cpu", help="carpool's device (cpu or cuda)")
    parser.add_argument("--model", default=MODEL, help="the built-in or a model folder")
    parser.add_argument(
        "--offline-engine",
        default="{}",
        help="EngineConfig fields of the offline reference, JSON (match --carpool-args)",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="load generator processes at each level (one Python client tops out near "
        "10k streamed tokens/s)",
    )
    parser.add_argument(
        "--no-naive", action="store_true", help="skip the naive server (it runs on the CPU)"
    )
    args = parser.parse_args()
    # Each level gets its own prompts: repeating one level's prompts at the next
    # would let carpool's prefix cache skip their prefill (the naive server has none).
    vocab = vocab_of(args.model)
    workloads = {
        c: [(p, 128) for p in token_prompts(args.requests, 32, 256, vocab, seed=3 + i)]
        for i, c in enumerate(args.concurrency)
    }
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    itl = 0.0
    if 1 in args.concurrency:  # the reference for one stream's inter-token latency
        itl = offline_itl(args.device, args.model, json.loads(args.offline_engine))
        if args.device.startswith("cuda"):
            # The offline engine's KV cache took its share of the GPU: give it back
            # before the server sizes its own.
            gc.collect()
            torch.cuda.empty_cache()
        print(f"offline engine, one stream: ITL p50 {itl * 1000:.0f} ms")
    results: dict[tuple[str, int], StreamResult] = {}

    port = free_port()
    carpool = [
        sys.executable,
        "-m",
        "carpool.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        args.model,
        "--device",
        args.device,
        *args.carpool_args.split(),
    ]
    served = MODEL
    if args.model != MODEL:  # a folder: served under a short name
        served = "bench"
        carpool += ["--served-model-name", served]
    process, _ = serve(carpool, r"carpool ready on (http://\S+)")
    url = f"http://127.0.0.1:{port}"
    try:
        for c in args.concurrency:
            load = workloads[c][: args.single_requests] if c == 1 else workloads[c]
            clients = min(c, args.client_processes)
            if args.warmup:  # its own prompts (no prefix-cache hits in the measured run)
                warm = token_prompts(c, 32, 256, vocab, seed=100 + c)
                run_streams_split(url, served, [(p, 128) for p in warm], c, clients)
            before = engine_counters(url, process.pid)  # type: ignore[attr-defined]
            results[("carpool", c)] = run_streams_split(url, served, load, c, clients)
            after = engine_counters(url, process.pid)  # type: ignore[attr-defined]
            print(row("carpool", results[("carpool", c)]), flush=True)
            # Over the streams' own span: the spawned clients' start (idle) is not in it.
            span = results[("carpool", c)].seconds
            print(engine_row(before, after, span), flush=True)
    finally:
        process.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        process.wait(60)  # type: ignore[attr-defined]

    if not args.no_naive:
        run_naive(args, workloads, results)

    print("\nside by side")
    for c in args.concurrency:
        ours, theirs = results[("carpool", c)], results.get(("naive", c))
        if theirs is None:
            print(f"c={c:<3} carpool {ours.tokens_per_s:7.1f} tok/s")
        else:
            ratio = ours.tokens_per_s / theirs.tokens_per_s
            print(f"c={c:<3} carpool/naive throughput {ratio:6.2f}x")
    one = results.get(("carpool", 1))
    if one is not None:
        print(f"c=1 carpool ITL p50 / offline ITL p50 = {percentile(one.itl_s, 50) / itl:.2f}")
    print("reproduce: python -m benchmarks.serving " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
