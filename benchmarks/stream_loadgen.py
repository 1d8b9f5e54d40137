"""A load generator for any OpenAI-compatible /v1/completions endpoint: streams a
seeded workload at a given concurrency (bounded in count and time) with ``carpool
bench``'s client (aiohttp) and reports output tokens/s (from the server's usage
fields), time to first token and inter-token latency."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass, field

import aiohttp

from carpool import event_loop
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
    # The load generator's own CPU time (all its threads) over the run: near
    # ``seconds`` means the client, not the server, may be what limits the rate.
    client_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    result: StreamResult,
    extra: dict[str, object] | None = None,
) -> None:
    """One greedy stream, EOS ignored, timed by ``carpool bench``'s client."""
    fields = {"temperature": 0, "ignore_eos": True, **(extra or {})}
    request = BenchRequest(prompt, max_tokens)
    outcome = await send(session, url, "/v1/completions", model, request, fields)
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
    cpu_started = time.process_time()

    async def worker(session: aiohttp.ClientSession) -> None:
        while todo and time.perf_counter() - started < time_limit_s:
            (prompt, max_tokens), extra = todo.pop(0)
            await _one(session, url, model, prompt, max_tokens, result, extra)

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=time_limit_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.seconds = time.perf_counter() - started
    result.client_cpu_s = time.process_time() - cpu_started
    return result


def run_streams_split(
    url: str,
    model: str,
    workload: list[tuple[list[int], int]],
    concurrency: int,
    processes: int,
) -> StreamResult:
    """``run_streams`` from ``processes`` client processes, each with every
    ``processes``-th request and its share of the concurrency, so that one Python
    client's CPU does not bound the rate measured. They start together (at a wall time
    set here, after their imports); the result is their sum over the span from the
    first start to the last end."""
    if processes <= 1:
        return event_loop.run(run_streams(url, model, workload, concurrency))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    start_at = time.time() + 5.0  # spawned interpreters import carpool's client first
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        parts = pool.starmap(
            _part,
            [(url, model, workload[i::processes], c, start_at) for i, c in enumerate(shares)],
        )
    merged = StreamResult(concurrency, len(workload), 0, 0, 0.0, 0)
    for part, _, _ in parts:
        merged.completed += part.completed
        merged.failed += part.failed
        merged.output_tokens += part.output_tokens
        merged.ttft_s += part.ttft_s
        merged.itl_s += part.itl_s
        merged.client_cpu_s += part.client_cpu_s
    merged.seconds = max(end for _, _, end in parts) - min(begin for _, begin, _ in parts)
    return merged


def _part(
    url: str, model: str, workload: list[tuple[list[int], int]], concurrency: int, start_at: float
) -> tuple[StreamResult, float, float]:
    """One client process's share: its result and its wall-clock start and end."""
    time.sleep(max(0.0, start_at - time.time()))
    begin = time.time()
    result = event_loop.run(run_streams(url, model, workload, max(1, concurrency)))
    return result, begin, time.time()
