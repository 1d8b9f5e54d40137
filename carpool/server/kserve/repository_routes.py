"""Triton's model repository extension: the index, load and unload, over
``ModelControl`` (``tritonclient``'s ``get_model_repository_index``, ``load_model``
and ``unload_model`` use these)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response

from carpool.errors import InvalidRequest
from carpool.server.registry.model_control import ModelControl


def router(control: ModelControl) -> APIRouter:
    api = APIRouter()

    @api.get("/v2/repository/index")
    @api.post("/v2/repository/index")
    async def index(request: Request) -> list[dict[str, Any]]:
        body = await _body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidRequest("'ready' must be a boolean", param="ready")
        return [
            {
                "name": e.name,
                **({"version": e.version} if e.version else {}),
                "state": e.state,
                **({"reason": e.reason} if e.reason else {}),
            }
            for e in control.index(ready_only=ready)
        ]

    @api.post("/v2/repository/models/{name}/load")
    async def load(name: str, request: Request) -> Response:
        refuse_overrides(await _body(request))
        await control.load(name)
        return Response(status_code=200)

    @api.post("/v2/repository/models/{name}/unload")
    async def unload(name: str, request: Request) -> Response:
        await _body(request)
        await control.unload(name)
        return Response(status_code=200)

    return api


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    return data


def refuse_overrides(body: dict[str, Any]) -> None:
    """A load may not carry a config or files of its own: carpool loads what the
    repository holds."""
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be an object", param="parameters")
    overrides = [k for k in params if k == "config" or k.startswith("file:")]
    if overrides:
        raise InvalidRequest(
            f"load parameter '{overrides[0]}' is not supported: carpool loads the model as "
            "the repository holds it",
            param=overrides[0],
        )
