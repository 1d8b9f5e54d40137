"""A bounded closed-loop load generator for /v1/embeddings-style endpoints."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)


async def run_load(
    url: str, model: str, texts: list[str], concurrency: int, time_limit_s: float = 300.0
) -> LoadResult:
    """Send each text once, ``concurrency`` at a time; stop early at ``time_limit_s``."""
    latencies: list[float] = []
    errors = 0
    next_index = 0
    deadline = time.monotonic() + time_limit_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, errors
        while next_index < len(texts) and time.monotonic() < deadline:
            text = texts[next_index]
            next_index += 1
            t0 = time.perf_counter()
            response = await client.post("/v1/embeddings", json={"model": model, "input": text})
            latencies.append(time.perf_counter() - t0)
            if response.status_code != 200:
                errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return LoadResult(len(latencies), errors, elapsed, latencies)
