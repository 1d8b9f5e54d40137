"""Open Inference Protocol (KServe v2) routes, as ``tritonclient.http`` expects them.

Every dynamic-batched model answers here through its kind's adapter
(``v2_models``); inference is answered by ``InferPath`` in front of the app's
routing; model control (Triton's repository extension) is in
``repository_routes``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.server.http import errors
from carpool.server.kserve.v2_models import (
    V2Model,
    adapter,
    all_stats,
    binary_outputs,
    server_metadata,
)
from carpool.server.kserve.v2_tensors import HEADER_LENGTH, encode_outputs, parse_request
from carpool.server.registry.served import ServedModels

INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


class InferPath:
    """ASGI middleware that answers ``POST /v2/models/{name}[/versions/{version}]/infer``
    itself and hands every other request on. It sits inside the guards (body limit, API
    key) and in front of FastAPI's exception, dependency and routing layers: on a small
    model those layers were a fifth of the event loop's time a request, and at
    concurrency 1 the event loop's time is the request's latency. Errors are answered
    by the app's own exception handlers (``handlers``, the app's live mapping), as any
    route's are."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        models: ServedModels,
        is_ready: Callable[[], bool],
        handlers: Mapping[Any, Callable[..., Any]],
    ) -> None:
        self.app = app
        self.models = models
        self.is_ready = is_ready
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            if scope["method"] != "POST":
                raise StarletteHTTPException(405, headers={"Allow": "POST"})
            response = await self._infer(request, match["name"], match["version"])
        except ClientDisconnect:
            raise  # the body was cut short (or over the limit): nobody to answer here
        except Exception as exc:
            response = await errors.handled(self.handlers, request, exc)
        await response(scope, receive, send)

    async def _infer(self, request: Request, name: str, version: str | None) -> Response:
        served = adapter(self.models, name, self.is_ready)
        body, blobs = parse_request(await request.body(), request.headers.get(HEADER_LENGTH))
        binary = binary_outputs(body)
        answer = await served.infer(body, blobs, request, version)
        content, header_len = encode_outputs(
            {
                "model_name": served.name,
                "model_version": served.version_of(version),
                **({"id": body.id} if body.id else {}),
                **({"parameters": dict(answer.parameters)} if answer.parameters else {}),
            },
            [(name, array, binary.get(name, binary[""])) for name, array in answer.outputs],
        )
        if header_len is None:
            return Response(content, media_type="application/json")
        return Response(
            content,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(header_len)},
        )


def router(models: ServedModels, is_ready: Callable[[], bool]) -> APIRouter:
    """Every other /v2 route (``InferPath`` answers inference)."""
    api = APIRouter()

    def model(name: str) -> V2Model:
        return adapter(models, name, is_ready)

    @api.get("/v2")
    async def metadata() -> dict[str, Any]:
        return server_metadata()

    @api.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @api.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if is_ready() else 503)

    @api.get("/v2/models/stats")
    async def every_stats() -> dict[str, Any]:
        return {"model_stats": all_stats(models, is_ready)}

    @api.get("/v2/models/{name}")
    @api.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None) -> dict[str, Any]:
        return model(name).metadata(version)

    @api.get("/v2/models/{name}/config")
    @api.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(name: str, version: str | None = None) -> dict[str, Any]:
        served = model(name)
        served.version_of(version)
        return served.config()

    @api.get("/v2/models/{name}/ready")
    @api.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None) -> Response:
        return Response(status_code=200 if await model(name).ready(version) else 503)

    @api.get("/v2/models/{name}/stats")
    @api.get("/v2/models/{name}/versions/{version}/stats")
    async def stats(name: str, version: str | None = None) -> dict[str, Any]:
        return {"model_stats": model(name).stats(version)}

    return api
