"""A load generator for any OpenAI-compatible /v1/completions endpoint: streams a
seeded workload at a given concurrency (async httpx, bounded in count and time)
and reports output tokens/s (from the server's usage fields), time to first token
and inter-token latency."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from carpool.bench.client import send
from carpool.bench.workload import BenchRequest


@dataclass
class StreamResult:
    concurrency: int
    requests: int
    completed: int
    failed: int
    seconds: float
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


async def _one(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    result: StreamResult,
    extra: dict[str, object] | None = None,
) -> None:
    """One greedy stream, EOS ignored, timed by ``carpool bench``'s client."""
    fields = {"temperature": 0, "ignore_eos": True, **(extra or {})}
    request = BenchRequest(prompt, max_tokens)
    outcome = await send(client, "/v1/completions", model, request, fields)
    if not outcome.ok:
        result.failed += 1
        return
    if outcome.ttft is not None:
        result.ttft_s.append(outcome.ttft)
    result.itl_s.extend(outcome.itl)
    result.output_tokens += outcome.output_tokens
    result.completed += 1


async def run_streams(
    url: str,
    model: str,
    workload: list[tuple[list[int], int]],
    concurrency: int,
    time_limit_s: float = 900.0,
    extras: list[dict[str, object] | None] | None = None,
) -> StreamResult:
    """``extras``: fields added to each request's body (aligned with ``workload``)."""
    result = StreamResult(concurrency, len(workload), 0, 0, 0.0, 0)
    todo = list(zip(workload, extras or [None] * len(workload), strict=True))
    started = time.perf_counter()

    async def worker(client: httpx.AsyncClient) -> None:
        while todo and time.perf_counter() - started < time_limit_s:
            (prompt, max_tokens), extra = todo.pop(0)
            try:
                await _one(client, model, prompt, max_tokens, result, extra)
            except httpx.HTTPError:
                result.failed += 1

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=time_limit_s, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result
