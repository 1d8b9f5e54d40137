"""Graceful drain: the outermost ASGI app. While draining, new requests get 503
with Retry-After and ``Connection: close`` (liveness and metrics still answer),
and the server waits for the requests in flight, streams included, to finish."""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.errors import error_body

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
        v2 = scope["path"].startswith("/v2")
        body = error_body(503, message, kind="overloaded_error", v2=v2)
        headers = {"Retry-After": "1", "Connection": "close"}
        await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
