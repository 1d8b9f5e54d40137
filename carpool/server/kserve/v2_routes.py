"""Open Inference Protocol (KServe v2) routes, as ``tritonclient.http`` expects them.

Every dynamic-batched model answers here through its kind's adapter
(``v2_models``); model control (Triton's repository extension) is in
``repository_routes``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.routing import Route

from carpool.server.kserve.v2_models import (
    V2Model,
    adapter,
    all_stats,
    binary_outputs,
    server_metadata,
)
from carpool.server.kserve.v2_tensors import HEADER_LENGTH, encode_outputs, parse_request
from carpool.server.registry.served import ServedModels


async def infer(
    models: ServedModels,
    is_ready: Callable[[], bool],
    request: Request,
    name: str,
    version: str | None,
) -> Response:
    """``POST /v2/models/{name}[/versions/{version}]/infer``: the body (JSON, or JSON
    then binary tensors) through the model kind's adapter; outputs as asked, binary
    where the request says so."""
    served = adapter(models, name, is_ready)
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


def infer_routes(models: ServedModels, is_ready: Callable[[], bool]) -> list[Route]:
    """Inference's two paths as plain Starlette routes, which the app puts first: as
    FastAPI routes among the others, its dependency solving and the scan past them
    cost 0.13 ms of a 0.8 ms call at c=1 (BENCHMARKS.md, session 39). Errors reach
    the app's handlers as any route's do."""

    async def endpoint(request: Request) -> Response:
        params = request.path_params
        return await infer(models, is_ready, request, params["name"], params.get("version"))

    return [
        Route("/v2/models/{name}/infer", endpoint, methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", endpoint, methods=["POST"]),
    ]


def router(models: ServedModels, is_ready: Callable[[], bool]) -> APIRouter:
    """Every other /v2 route (``infer_routes``: inference; ``repository_routes``:
    model control)."""
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
