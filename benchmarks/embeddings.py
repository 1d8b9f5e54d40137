"""Embedding throughput and latency: carpool vs a naive one-at-a-time server vs the
in-process ceiling (sentence-transformers, length-sorted batches of 64), in one run.

    python benchmarks/embeddings.py [--requests 2000] [--concurrency 1 8 32 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
from sentence_transformers import SentenceTransformer

from benchmarks.loadgen import LoadResult, run_load
from benchmarks.workload import sentences
from carpool.models.registry import BUILTIN_MODELS
from carpool.testing import free_port, spawn

MODEL = "all-minilm-l6-v2"


def ours_in_process(texts: list[str]) -> float:
    """carpool's own encoder, no server: sentences/s in sorted batches of 64."""
    from carpool.models.embedding import EmbeddingModel

    model = EmbeddingModel(BUILTIN_MODELS[MODEL].locate())
    model.embed(texts[:64])
    ordered = sorted(texts, key=len)
    started = time.perf_counter()
    for i in range(0, len(ordered), 64):
        model.embed(ordered[i : i + 64])
    return len(texts) / (time.perf_counter() - started)


def in_process(texts: list[str]) -> tuple[float, float]:
    """(sentences/s in sorted batches of 64, median seconds of one single encode)."""
    model = SentenceTransformer(str(BUILTIN_MODELS[MODEL].locate()), device="cpu")
    model.encode(texts[:64], batch_size=64)
    ordered = sorted(texts, key=len)
    started = time.perf_counter()
    for i in range(0, len(ordered), 64):
        model.encode(ordered[i : i + 64], batch_size=64)
    ceiling = len(texts) / (time.perf_counter() - started)
    singles = []
    for text in texts[:300]:
        t0 = time.perf_counter()
        model.encode([text])
        singles.append(time.perf_counter() - t0)
    return ceiling, statistics.median(singles)


def measure(
    name: str, command: list[str], ready: str, texts: list[str], levels: list[int]
) -> dict[int, LoadResult]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    process, match, _ = spawn(command, re.compile(ready), env=env)
    url = match.group(1)
    results = {}
    try:
        asyncio.run(run_load(url, MODEL, texts[:64], 8))  # warm-up
        for c in levels:
            results[c] = asyncio.run(run_load(url, MODEL, texts, c))
            r = results[c]
            print(
                f"  {name:8} c={c:<4} {r.rps:7.1f} req/s  p50 {r.p50 * 1e3:7.1f} ms  "
                f"p90 {r.pct(0.9) * 1e3:7.1f} ms  p99 {r.pct(0.99) * 1e3:7.1f} ms  "
                f"errors {r.errors}",
                flush=True,
            )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--carpool-args", default="", help="extra flags for carpool serve")
    args = parser.parse_args()
    texts = sentences(args.requests)
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.requests} requests",
        flush=True,
    )
    ceiling, single = in_process(texts)
    print(
        f"  in-process ceiling (sorted batches of 64): {ceiling:.1f} sentences/s; "
        f"single encode p50 {single * 1e3:.1f} ms",
        flush=True,
    )
    ours = ours_in_process(texts)
    print(
        f"  carpool's encoder in-process (sorted batches of 64): {ours:.1f} sentences/s", flush=True
    )
    carpool = measure(
        "carpool",
        [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", *args.carpool_args.split()],
        r"carpool ready on (http://\S+)",
        texts,
        args.concurrency,
    )
    port = free_port()
    naive = measure(
        "naive",
        [sys.executable, "-m", "benchmarks.naive_embedding_server", str(port)],
        r"naive ready on (http://\S+)",
        texts,
        args.concurrency,
    )
    print("\nsummary")
    top, low = max(args.concurrency), min(args.concurrency)
    print(
        f"  c={top}: carpool / ceiling = {carpool[top].rps / ceiling:.2f}, "
        f"carpool / naive = {carpool[top].rps / naive[top].rps:.2f}"
    )
    print(f"  c={low}: carpool p50 / single in-process encode = {carpool[low].p50 / single:.2f}")
    out = Path("benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(
        json.dumps(
            {
                "ceiling_sps": ceiling,
                "ours_in_process_sps": ours,
                "single_p50_s": single,
                "carpool": {c: r.summary() for c, r in carpool.items()},
                "naive": {c: r.summary() for c, r in naive.items()},
            },
            indent=1,
        )
    )
    print("\nreproduce: python benchmarks/embeddings.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
