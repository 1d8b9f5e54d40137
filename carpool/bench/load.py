"""Driving a server: warm-up, then the timed requests in a closed loop (a fixed
number of clients) or an open loop (arrivals at a rate, gamma-distributed gaps:
Poisson at burstiness 1, vLLM's model), with a progress bar; bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from tqdm import tqdm

from carpool.bench.client import send
from carpool.bench.config import BenchConfig
from carpool.bench.metrics import ClientRecord
from carpool.bench.workload import BenchRequest


def gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Seconds between arrivals: gamma with mean ``1 / rate`` and shape
    ``burstiness`` (0 forever when the rate is infinite)."""
    while True:
        yield 0.0 if rate == float("inf") else rng.gammavariate(burstiness, 1 / (rate * burstiness))


def _extra(config: BenchConfig) -> dict[str, Any]:
    if config.endpoint == "/v1/embeddings":
        return {}
    extra: dict[str, Any] = {"temperature": config.temperature}
    if config.ignore_eos:
        extra["ignore_eos"] = True
    return extra


async def drive(
    config: BenchConfig,
    requests: list[BenchRequest],
    warmups: list[BenchRequest],
    *,
    rate: float,
    concurrency: int,
    progress: bool = True,
) -> tuple[list[ClientRecord], float]:
    """Send ``warmups`` (untimed) then ``requests``: closed loop when ``concurrency``
    > 0, else open loop at ``rate`` (capped at ``config.max_concurrency`` in
    flight). Each outcome, in request order, with ``sent`` counted from the start of
    the timed part, and the timed duration."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    width = max(concurrency, config.max_concurrency, 1) + 8
    # 0: no limit on connections (an open loop without max_concurrency).
    connector = aiohttp.TCPConnector(limit=width if concurrency or config.max_concurrency else 0)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    extra = _extra(config)
    url = config.base_url.rstrip("/")
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout
    ) as client:
        for request in warmups:
            await send(client, url, config.endpoint, config.model, request, extra)
        outcomes: list[ClientRecord | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=not progress, unit="req", leave=False)

        async def one(i: int) -> None:
            outcomes[i] = await send(client, url, config.endpoint, config.model, requests[i], extra)
            bar.update()

        started = time.perf_counter()
        with contextlib.suppress(TimeoutError):  # what did not finish counts as failed
            await asyncio.wait_for(
                _closed(one, len(requests), concurrency)
                if concurrency
                else _open(one, len(requests), rate, config),
                timeout=config.timeout_s,
            )
        duration = time.perf_counter() - started
        bar.close()
    done = [o or ClientRecord(None, sent=started) for o in outcomes]
    for o in done:
        o.sent -= started
    return done, duration


async def _closed(one: Any, count: int, concurrency: int) -> None:
    todo = iter(range(count))

    async def client_loop() -> None:
        for i in todo:
            await one(i)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))


async def _open(one: Any, count: int, rate: float, config: BenchConfig) -> None:
    cap = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async def capped(i: int) -> None:
        if cap is None:
            await one(i)
            return
        async with cap:
            await one(i)

    rng = random.Random(config.seed)
    tasks = []
    for i, gap in zip(range(count), gaps(rate, config.burstiness, rng), strict=False):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.ensure_future(capped(i)))
    await asyncio.gather(*tasks)
