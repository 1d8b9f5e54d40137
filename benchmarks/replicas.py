"""Replicas on Ray Serve against one process, on this machine, in one run:

1. throughput at concurrency 64 (``benchmarks.serving``'s workload: 64 prompts of
   32-256 random tokens, 128 new tokens each): ``--replicas 2`` (one core each)
   against one process on all the cores, both servers up, runs alternating;
2. the Ray hop at concurrency 1: ``--replicas 1`` (all the cores) against one
   process: added TTFT p50 and ITL p50, runs alternating;
3. shared prefixes (``--prefixes`` system prompts of ~400 tokens, each request one of
   them plus a short question, 32 new tokens): prefix-affinity routing against Ray
   Serve's power-of-two routing, both on ``--replicas 2`` with 512 MiB of KV cache
   each: prefix-cache hit rate (from the endpoint's /metrics) and throughput.

    python -m benchmarks.replicas [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving import row
from benchmarks.stream_loadgen import StreamResult, run_streams
from benchmarks.workload import sentences, token_prompts
from carpool.bench.metrics import percentile
from carpool.testing import free_port, spawn

MODEL = "smollm2-135m-instruct"
READY = re.compile(r"carpool ready on (http://\S+)")
KV = "512MiB"
"""Each replica's KV cache in part 3: room for about 20 of the ~400-token prefixes
beside the running requests, so 32 prefixes fit on two replicas only if split."""


@contextmanager
def server(*flags: str) -> Iterator[str]:
    """A ``carpool serve`` of the chat model with ``flags``; its URL."""
    command = [sys.executable, "-m", "carpool.cli", "serve", "--model", MODEL]
    command += ["--port", str(free_port()), *flags]
    process, match, _ = spawn(command, READY, 600.0, {**os.environ})
    try:
        yield match.group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()


def prefix_counters(url: str) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens), summed over the replicas."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = {"carpool_prefix_cache_hits_total": 0.0, "carpool_prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("model") == MODEL:
                totals[sample.name] += sample.value
    return totals["carpool_prefix_cache_hits_total"], totals["carpool_prefix_cache_queries_total"]


def tokens_by_replica(url: str) -> list[int]:
    """Tokens each replica generated so far (one entry for a single process)."""
    ready = httpx.get(f"{url}/health", timeout=30).json().get("replicas_ready")
    text = httpx.get(f"{url}/metrics", timeout=30).text
    print(f"  ({ready} replicas ready)")
    return [
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "carpool_generation_tokens_total" and sample.labels["model"] == MODEL
    ]


def shared_prefix_workload(prefixes: int, requests: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    text = sentences(4000, seed=seed)
    systems = [" ".join(rng.sample(text, 40))[:1800] for _ in range(prefixes)]
    return [
        (f"{rng.choice(systems)}\nQuestion {i}: {rng.choice(text)}\nAnswer:", 32)
        for i in range(requests)
    ]


def throughput(rounds: int, requests: int) -> list[float]:
    ratios = []
    with server() as one, server("--replicas", "2") as two:
        for r in range(rounds):
            load = [(p, 128) for p in token_prompts(requests, 32, 256, 49152, seed=100 + r)]
            plain = asyncio.run(run_streams(one, MODEL, load, 64))  # type: ignore[arg-type]
            ray = asyncio.run(run_streams(two, MODEL, load, 64))  # type: ignore[arg-type]
            print(row("1 process", plain))
            spread = tokens_by_replica(two)
            print(f"{row('2 replicas', ray)}  tokens by replica {spread}", flush=True)
            ratios.append(ray.tokens_per_s / plain.tokens_per_s)
    return ratios


def hop(rounds: int, requests: int) -> tuple[list[float], list[float]]:
    ttft, itl = [], []
    with server() as one, server("--replicas", "1") as ray_one:
        for r in range(rounds):
            load = [(p, 128) for p in token_prompts(requests, 32, 256, 49152, seed=200 + r)]
            plain = asyncio.run(run_streams(one, MODEL, load, 1))  # type: ignore[arg-type]
            ray = asyncio.run(run_streams(ray_one, MODEL, load, 1))  # type: ignore[arg-type]
            print(row("1 process", plain))
            print(row("1 replica", ray), flush=True)
            ttft.append(percentile(ray.ttft_s, 50) - percentile(plain.ttft_s, 50))
            itl.append(percentile(ray.itl_s, 50) - percentile(plain.itl_s, 50))
    return ttft, itl


def affinity(rounds: int, prefixes: int, requests: int) -> dict[str, list[tuple[float, float]]]:
    seen: dict[str, list[tuple[float, float]]] = {"prefix": [], "power_of_two": []}
    for r in range(rounds):
        load = shared_prefix_workload(prefixes, requests, seed=300 + r)
        for policy in seen:
            flags = ("--replicas", "2", "--route-policy", policy, "--kv-cache-memory", KV)
            with server(*flags) as url:
                hits0, queries0 = prefix_counters(url)
                result: StreamResult = asyncio.run(run_streams(url, MODEL, load, 16))  # type: ignore[arg-type]
                hits, queries = prefix_counters(url)
                spread = tokens_by_replica(url)
            rate = (hits - hits0) / max(1.0, queries - queries0)
            print(f"{row(policy, result)}  hit rate {rate:.1%}, by replica {spread}", flush=True)
            seen[policy].append((rate, result.tokens_per_s))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=32)
    parser.add_argument("--prefix-requests", type=int, default=192)
    parser.add_argument("--parts", nargs="+", default=["throughput", "hop", "affinity"])
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}")
    if "throughput" in args.parts:
        ratios = throughput(args.rounds, args.requests)
        print(
            f"c=64 throughput, 2 replicas / 1 process: {[f'{x:.2f}' for x in ratios]}, "
            f"median {statistics.median(ratios):.2f}x\n"
        )
    if "hop" in args.parts:
        ttft, itl = hop(args.rounds, args.single_requests)
        print(
            f"c=1 Ray hop: added TTFT p50 {[f'{x * 1000:.1f}' for x in ttft]} ms, "
            f"added ITL p50 {[f'{x * 1000:.2f}' for x in itl]} ms; medians "
            f"{statistics.median(ttft) * 1000:.1f} / {statistics.median(itl) * 1000:.2f} ms\n"
        )
    if "affinity" in args.parts:
        seen = affinity(args.rounds, args.prefixes, args.prefix_requests)
        for policy, runs in seen.items():
            rates = [f"{rate:.1%}" for rate, _ in runs]
            tps = [f"{t:.1f}" for _, t in runs]
            print(f"{policy:13} hit rate {rates}, tokens/s {tps}")
    print("reproduce: python -m benchmarks.replicas " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
