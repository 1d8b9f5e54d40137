"""``carpool bench``: one run, or a sweep of runs over request rates or
concurrencies, each on fresh prompts (so no prefix cache serves a repeated one);
a table on the terminal, optionally a JSON file and PNG figures."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from carpool import event_loop
from carpool.bench.config import BenchConfig
from carpool.bench.load import drive
from carpool.bench.metrics import samples, summarize, timeline
from carpool.bench.workload import (
    BenchRequest,
    jsonl_requests,
    prefix_requests,
    random_requests,
    sharegpt_requests,
)


def requests_for(config: BenchConfig, count: int, rng: random.Random) -> list[BenchRequest]:
    """``count`` requests of the configured dataset, drawn from ``rng``."""
    if config.dataset == "sharegpt":
        return sharegpt_requests(count, rng)
    if config.dataset == "prefix":
        return prefix_requests(
            count,
            config.prefix_len,
            config.num_prefixes,
            config.suffix_len,
            config.random_output_len,
            rng,
        )
    if config.dataset == "jsonl":
        return jsonl_requests(Path(config.dataset_path), count, config.random_output_len)
    return random_requests(
        count, config.random_input_len, config.random_output_len, config.random_range_ratio, rng
    )


def points(config: BenchConfig) -> list[tuple[str, float, int]]:
    """(label, request rate, concurrency) of each run."""
    if config.sweep_concurrencies:
        return [(f"concurrency {c}", math.inf, c) for c in config.sweep_concurrencies]
    if config.sweep_request_rates:
        return [(f"rate {r:g}/s", r, 0) for r in config.sweep_request_rates]
    if config.concurrency:
        return [(f"concurrency {config.concurrency}", math.inf, config.concurrency)]
    return [(f"rate {config.request_rate:g}/s", config.request_rate, 0)]


def run(config: BenchConfig, progress: bool = True) -> list[dict[str, Any]]:
    """Every run's summary (with its label, rate and concurrency), in order."""
    results = []
    for n, (label, rate, concurrency) in enumerate(points(config)):
        rng = random.Random(config.seed * 1000 + n)
        if config.dataset == "jsonl":
            timed, warm = requests_for(config, config.num_prompts, rng), []
        else:
            warm = requests_for(config, config.num_warmups, random.Random(-1 - n))
            timed = requests_for(config, config.num_prompts, rng)
        outcomes, duration = event_loop.run(
            drive(config, timed, warm, rate=rate, concurrency=concurrency, progress=progress)
        )
        summary = summarize(outcomes, duration, config.percentiles, config.slos_ms())
        detail = {
            "ttfts_ms": [v * 1000 for v in samples(outcomes, "ttft")],
            "itls_ms": [v * 1000 for v in samples(outcomes, "itl")],
            "output_throughput_per_s": timeline(outcomes, duration),
        }
        results.append(
            {"label": label, "request_rate": rate, "concurrency": concurrency, **summary, **detail}
        )
    return results


def table(config: BenchConfig, results: list[dict[str, Any]]) -> str:
    """The results as a text table, one run a column."""
    Row = tuple[str, Callable[[dict[str, Any]], str]]
    rows: list[Row] = [
        ("completed / failed", lambda r: f"{r['completed']} / {r['failed']}"),
        ("request throughput (req/s)", lambda r: f"{r['request_throughput']:.2f}"),
        ("output throughput (tok/s)", lambda r: f"{r['output_throughput']:.1f}"),
        ("total token throughput (tok/s)", lambda r: f"{r['total_token_throughput']:.1f}"),
    ]
    if config.goodput:
        rows.append(("goodput (req/s)", lambda r: f"{r['goodput']:.2f}"))
    metrics = ["e2el"] if config.endpoint == "/v1/embeddings" else ["ttft", "tpot", "itl", "e2el"]
    for metric in metrics:
        for stat in ("mean", "median", *(f"p{q:g}" for q in config.percentiles)):
            rows.append((f"{stat} {metric.upper()} (ms)", _number(f"{stat}_{metric}_ms")))
    rows.append(("errors", _errors))
    head = [f"{'':32}", *(f"{r['label']:>16}" for r in results)]
    lines = [" ".join(head)]
    lines += [" ".join([f"{name:32}", *(f"{fmt(r):>16}" for r in results)]) for name, fmt in rows]
    return "\n".join(lines)


def _number(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{r[key]:.1f}"


def _errors(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in result["errors"].items()) or "-"


def save(config: BenchConfig, results: list[dict[str, Any]]) -> None:
    """The JSON file and the figures, where asked for."""
    if config.result_file:
        Path(config.result_file).write_text(
            json.dumps({"config": config.__dict__, "results": results}, indent=2, default=str)
        )
    if config.plot_dir:
        from carpool.bench.plots import plot

        plot(results, Path(config.plot_dir))
