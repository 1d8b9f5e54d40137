"""Optional API key: ASGI middleware that refuses model endpoints without
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header) (401 in
the endpoint's protocol shape). Health,
readiness, server metadata, metrics and the dashboard's page (not its data) stay
open. The comparison takes the same time however much of the key matches."""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.http.errors import error_body

OPEN_PATHS = ("/health", "/metrics", "/v2/health/live", "/v2/health/ready", "/v2", "/dashboard")
# The dashboard's page and scripts hold no data; its statistics need the key.
OPEN_PREFIXES = ("/dashboard/assets/",)


def needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)


class ApiKey:
    """The server's API key, compared in the same time however much of a key matches."""

    def __init__(self, api_key: str) -> None:
        # Compare digests: equal length whatever the client sends, so neither length
        # nor matching prefix shows in the timing.
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _matches(self, token: bytes) -> bool:
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)

    def accepts(self, authorization: bytes, x_api_key: bytes) -> bool:
        """Whether ``Authorization: Bearer <key>`` or (Anthropic's) ``x-api-key: <key>``
        carries the key."""
        scheme, _, token = authorization.partition(b" ")
        bearer = self._matches(token) and scheme.lower() == b"bearer"
        return bearer | self._matches(x_api_key)


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = ApiKey(api_key)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        return self.key.accepts(headers.get(b"authorization", b""), headers.get(b"x-api-key", b""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "missing or wrong API key (send Authorization: Bearer <key>, or x-api-key)"
        body = error_body(401, message, kind="authentication_error", path=scope["path"])
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
