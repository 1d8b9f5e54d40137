"""An HTTP request carried from the ingress to a replica as plain data, and the replica's
side: run it through the replica's own ASGI app, in process, and hand back the
response as it is sent (head first, then body chunks, so streams are not buffered).

No Ray here: both halves are plain asyncio, tested without a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message

log = logging.getLogger("carpool")


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request, whole. ``prefix_text`` is what prefix-affinity routing reads
    (the prompt, or empty); ``replica`` pins the request to one replica (the
    ingress's fan-out for /metrics and /health), empty for any; ``avoid`` names
    replicas that said they cannot run it."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix_text: str = ""
    replica: str = ""
    avoid: tuple[str, ...] = ()


class ReplicaUnavailable(Exception):
    """Raised by a replica whose device runtime has died, before it starts a request:
    the ingress sends the request to another replica while Ray replaces this one."""

    def __init__(self, replica: str) -> None:
        super().__init__(replica)
        self.replica = replica


@dataclass(frozen=True)
class ResponseHead:
    """Status and headers; ``body`` is the first body bytes when they came with it
    (a whole non-streamed response is one message), ``more`` whether chunks follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes = b""
    more: bool = True


@dataclass(frozen=True)
class ReplicaReport:
    """What a replica says of itself to the ingress's /health and /metrics."""

    replica: str
    pid: int
    ready: bool
    metrics: str = ""


@dataclass
class _Exchange:
    request: ForwardedRequest
    sent: asyncio.Queue[Message | None] = field(default_factory=asyncio.Queue)
    body_taken: bool = False
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    async def receive(self) -> Message:
        if not self.body_taken:
            self.body_taken = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        await self.sent.put(message)


def _scope(request: ForwardedRequest) -> dict[str, object]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode("latin-1"),
        "query_string": request.query_string,
        "root_path": "",
        "headers": list(request.headers),
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through ``app``; yield its ``ResponseHead``, then each further
    body chunk as the app sends it. Closing the iterator early (the client left) tells
    the app the client disconnected and waits for it to stop."""
    exchange = _Exchange(request)

    async def run() -> None:
        try:
            await app(_scope(request), exchange.receive, exchange.send)
        except Exception:
            # Starlette re-raises after sending its 500: the client has its answer,
            # the log has the trace.
            log.exception("unhandled error on %s %s", request.method, request.path)
        finally:
            await exchange.sent.put(None)

    task = asyncio.create_task(run())
    try:
        head = await _head(exchange)
        yield head
        if head.more:
            while (message := await exchange.sent.get()) is not None:
                if message["type"] != "http.response.body":
                    continue
                if chunk := message.get("body", b""):
                    yield chunk
                if not message.get("more_body", False):
                    break
        await task
    finally:
        exchange.gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()


async def _head(exchange: _Exchange) -> ResponseHead:
    start: Message | None = None
    while (message := await exchange.sent.get()) is not None:
        if message["type"] == "http.response.start":
            start = message
        elif message["type"] == "http.response.body" and start is not None:
            return ResponseHead(
                status=int(start["status"]),
                headers=tuple((bytes(k), bytes(v)) for k, v in start.get("headers", [])),
                body=message.get("body", b""),
                more=bool(message.get("more_body", False)),
            )
    raise RuntimeError("the app ended without a response")
