"""A load generator for any OpenAI-compatible /v1/completions endpoint: streams a
seeded workload at a given concurrency (async httpx, bounded in count and time)
and reports output tokens/s (from the server's usage fields), time to first token
and inter-token latency."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def _one(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    max_tokens: int,
    result: StreamResult,
    extra: dict[str, object] | None = None,
) -> None:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    started = time.perf_counter()
    last: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.failed += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if last is None:
                    result.ttft_s.append(now - started)
                else:
                    result.itl_s.append(now - last)
                last = now
    result.output_tokens += tokens
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
