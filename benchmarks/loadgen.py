"""A bounded closed-loop load generator for /v1/embeddings-style endpoints."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp


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

    def summary(self) -> dict[str, float]:
        return {
            "rps": self.rps,
            "p50": self.p50,
            "p90": self.pct(0.9),
            "p99": self.pct(0.99),
            "errors": self.errors,
        }


async def run_load(
    url: str, model: str, texts: list[str], concurrency: int, time_limit_s: float = 300.0
) -> LoadResult:
    """Send each text once, ``concurrency`` at a time; stop early at ``time_limit_s``.

    aiohttp rather than httpx: at 128 connections httpx's pool alone saturated a
    core of this 2-core machine, so the benchmark measured the client."""
    latencies: list[float] = []
    errors = 0
    next_index = 0
    deadline = time.monotonic() + time_limit_s
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120.0)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_index, errors
        while next_index < len(texts) and time.monotonic() < deadline:
            text = texts[next_index]
            next_index += 1
            t0 = time.perf_counter()
            async with session.post(
                url + "/v1/embeddings", json={"model": model, "input": text}
            ) as response:
                await response.read()
                ok = response.status == 200
            latencies.append(time.perf_counter() - t0)
            if not ok:
                errors += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return LoadResult(len(latencies), errors, elapsed, latencies)
