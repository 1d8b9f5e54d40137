"""ASGI middleware that refuses request bodies over a size limit with 413, without
reading a body whole: it checks Content-Length first and counts streamed bytes."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from carpool.server.http.errors import error_body


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, send)
            return
        seen = 0
        too_large = False

        async def counted_receive() -> Message:
            # Past the limit the app is told the client left, so it stops reading (an
            # exception here would be turned into a 400 by the body parser).
            nonlocal seen, too_large
            if too_large:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:  # the 413 below is the only answer to an over-large body
                await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large:
            await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = f"request body is larger than the limit of {self.max_bytes} bytes"
        path = str(scope.get("path", ""))
        payload = json.dumps(error_body(413, message, path=path)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
