"""Graceful drain: the outermost ASGI app. While draining, new requests get 503
with Retry-After and ``Connection: close`` (liveness and metrics still answer),
and the server waits for the requests in flight, streams included, to finish.
``DrainingServer`` is uvicorn over it, draining on SIGTERM/SIGINT: ``carpool serve``
and the ``--replicas`` front both run one."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.http.errors import error_body

log = logging.getLogger("carpool")

ALWAYS_OPEN = ("/health", "/v2/health/live", "/metrics")


class Drain:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] not in ALWAYS_OPEN:
            await self._refuse(scope, receive, send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def idle(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight (True) or ``timeout_s`` passes (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = "the server is shutting down"
        body = error_body(503, message, kind="overloaded_error", path=scope["path"])
        headers = {"Retry-After": "1", "Connection": "close"}
        await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)


class DrainingServer:
    """uvicorn serving ``Drain(app)`` on a bound socket. SIGTERM or SIGINT starts the
    drain: the socket stays open (new requests get 503), the requests in flight finish
    (up to ``timeout_s``), then the server stops; a second signal stops it at once."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        log_level: str,
        timeout_s: float,
        on_drain: Callable[[], object] | None = None,
    ) -> None:
        self.drain = Drain(app)
        self.on_drain = on_drain  # told when the drain begins (the gRPC server's stop)
        self.timeout_s = timeout_s
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.drain,
                log_level=log_level,
                access_log=log_level == "debug",
                timeout_graceful_shutdown=1,
            )
        )
        self._finishing: asyncio.Future[None] | None = None

    async def serve(self, socks: list[socket.socket], ready_line: str) -> None:
        """Serve on ``socks`` until stopped; ``ready_line`` is logged once the server
        listens."""
        serving = asyncio.create_task(self.server.serve(sockets=socks))
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.01)
        if self.server.started:
            self._take_signals(asyncio.get_running_loop())
            log.info(ready_line)
        await serving

    def stop(self) -> None:
        """Stop without draining (any thread's signal handler may ask; uvicorn polls)."""
        self.server.should_exit = True

    def _take_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """Replace uvicorn's SIGTERM/SIGINT handlers with the drain."""

        def handler(signum: int, _frame: object) -> None:
            loop.call_soon_threadsafe(self.begin_drain, signal.Signals(signum).name)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)

    def begin_drain(self, reason: str) -> None:
        if self.drain.draining:  # a second signal: stop now
            self.server.should_exit = self.server.force_exit = True
            return
        self.drain.draining = True
        if self.on_drain is not None:
            self.on_drain()
        log.info(
            "%s: draining %d requests in flight (up to %.0fs)",
            reason,
            self.drain.in_flight,
            self.timeout_s,
        )
        self._finishing = asyncio.ensure_future(self._finish())

    async def _finish(self) -> None:
        if not await self.drain.idle(self.timeout_s):
            log.warning(
                "shutdown timeout: %d requests still in flight are cut", self.drain.in_flight
            )
        self.stop()
