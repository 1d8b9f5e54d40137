"""Batching seen from outside: requests share batches, knobs take effect, overload is
refused early, queued requests time out or are dropped when their client leaves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import MODEL, Server, start_server, stop_server


@pytest.fixture(scope="module")
def batching_server() -> Iterator[Server]:
    # A long delay with preferred size 4: a batch goes exactly when 4 requests wait.
    s = start_server(
        "--model",
        MODEL,
        "--max-queue-delay-ms",
        "20000",
        "--preferred-batch-sizes",
        "4",
        "--max-batch-size",
        "4",
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def holding_server() -> Iterator[Server]:
    # Requests wait (up to a minute) unless their own timeout ends them first; at most 2 queue.
    s = start_server(
        "--model",
        MODEL,
        "--max-queue-delay-ms",
        "60000",
        "--max-queue-size",
        "2",
        "--max-batch-size",
        "8",
    )
    yield s
    assert stop_server(s) == 0


async def _embed_all(url: str, texts: list[str], **extra: object) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        return list(
            await asyncio.gather(
                *(
                    c.post("/v1/embeddings", json={"model": MODEL, "input": t, **extra})
                    for t in texts
                )
            )
        )


def test_concurrent_requests_share_batches(batching_server: Server) -> None:
    responses = asyncio.run(
        _embed_all(batching_server.url, [f"sentence number {i}" for i in range(8)])
    )
    assert all(r.status_code == 200 for r in responses)
    stats = batching_server.stats()
    assert stats["inference_count"] == 8
    assert stats["execution_count"] == 2
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (4, 2)
    ]


def test_a_full_queue_answers_503_with_retry_after_at_once(holding_server: Server) -> None:
    async def scenario() -> tuple[list[httpx.Response], httpx.Response, bool]:
        async with httpx.AsyncClient(base_url=holding_server.url, timeout=60.0) as c:
            body = {"model": MODEL, "input": "waiting", "timeout": 2.0}
            held = [asyncio.create_task(c.post("/v1/embeddings", json=body)) for _ in range(2)]
            while holding_server.metric("carpool_pending_requests", model=MODEL) < 2:
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/embeddings", json={"model": MODEL, "input": "one too many"})
            first = not any(task.done() for task in held)
            return list(await asyncio.gather(*held)), refused, first

    held, refused, refused_first = asyncio.run(scenario())
    # "At once": refused while the requests ahead of it were still waiting.
    assert refused_first
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "overloaded_error"
    # The held requests hit their own 2 s timeout: 504, and they never ran.
    assert [r.status_code for r in held] == [504, 504]
    assert "timed out" in held[0].json()["error"]["message"]
    stats = holding_server.stats()
    assert stats["execution_count"] == 0
    assert holding_server.metric("carpool_requests_total", model=MODEL, outcome="timeout") == 2
    assert holding_server.metric("carpool_requests_total", model=MODEL, outcome="rejected") == 1


def test_a_request_whose_client_left_is_dropped_before_it_runs(holding_server: Server) -> None:
    before = holding_server.metric("carpool_requests_total", model=MODEL, outcome="cancelled")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=holding_server.url, timeout=60.0) as c:
            task = asyncio.create_task(
                c.post("/v1/embeddings", json={"model": MODEL, "input": "bye"})
            )
            while holding_server.metric("carpool_pending_requests", model=MODEL) < 1:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while (
        holding_server.metric("carpool_pending_requests", model=MODEL) > 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert holding_server.metric("carpool_pending_requests", model=MODEL) == 0
    assert (
        holding_server.metric("carpool_requests_total", model=MODEL, outcome="cancelled")
        == before + 1
    )
    assert holding_server.stats()["execution_count"] == 0
