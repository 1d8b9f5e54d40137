"""A request carried as plain data through a real ASGI app in process, and many
replicas' metrics merged into one exposition."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from carpool.distributed.forward import ForwardedRequest, ResponseHead, call_app
from carpool.distributed.metrics_merge import merge_metrics


def make_app(seen: list[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, object]:
        body = await request.json()
        return {"got": body, "query": request.url.query, "key": request.headers.get("x-key")}

    @app.get("/boom")
    async def boom() -> None:
        raise ValueError("a bug")

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def chunks():  # type: ignore[no-untyped-def]
            try:
                for i in range(1000):
                    yield f"chunk {i}\n"
                    await asyncio.sleep(0)
            finally:
                seen.append("closed")

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


async def collect(app: FastAPI, request: ForwardedRequest, limit: int = 10**6) -> list[object]:
    parts: list[object] = []
    async for part in call_app(app, request):
        parts.append(part)
        if len(parts) >= limit:
            break
    return parts


def test_a_whole_response_comes_back_as_one_head() -> None:
    request = ForwardedRequest(
        "POST",
        "/echo",
        b"a=1",
        ((b"content-type", b"application/json"), (b"x-key", b"k")),
        b'{"hello": "world"}',
    )
    parts = asyncio.run(collect(make_app([]), request))
    assert len(parts) == 1
    head = parts[0]
    assert isinstance(head, ResponseHead) and head.status == 200 and not head.more
    assert head.body == b'{"got":{"hello":"world"},"query":"a=1","key":"k"}'
    assert (b"content-type", b"application/json") in head.headers


def test_a_stream_comes_in_chunks_and_leaving_early_stops_the_app() -> None:
    seen: list[str] = []
    request = ForwardedRequest("GET", "/stream", b"", (), b"")

    async def run() -> list[object]:
        parts = await collect(make_app(seen), request, limit=3)
        return parts

    parts = asyncio.run(run())
    head = parts[0]
    assert isinstance(head, ResponseHead) and head.more and head.body == b"chunk 0\n"
    assert parts[1:] == [b"chunk 1\n", b"chunk 2\n"]
    assert seen == ["closed"]


def test_errors_of_the_app_come_back_as_its_own_responses() -> None:
    parts = asyncio.run(collect(make_app([]), ForwardedRequest("GET", "/nope", b"", (), b"")))
    head = parts[0]
    assert isinstance(head, ResponseHead) and head.status == 404


def test_an_unhandled_error_is_the_apps_500_and_the_exchange_ends_cleanly() -> None:
    parts = asyncio.run(collect(make_app([]), ForwardedRequest("GET", "/boom", b"", (), b"")))
    head = parts[0]
    assert len(parts) == 1 and isinstance(head, ResponseHead) and head.status == 500


def exposition(value: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("carpool_requests", "Requests.", ["model"], registry=registry)
    counter.labels(model="m").inc(value)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    text = merge_metrics({"r1": exposition(2), "r2": exposition(5)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {
        s.labels["replica"]: s.value
        for s in families["carpool_requests"].samples
        if s.name == "carpool_requests_total"
    }
    assert samples == {"r1": 2.0, "r2": 5.0}
    assert text.count("# HELP carpool_requests_total") == 1
    assert families["carpool_replicas"].samples[0].value == 2.0
