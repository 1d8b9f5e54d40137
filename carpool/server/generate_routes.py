"""Triton's generate extension for repository models: ``POST
/v2/models/NAME[/versions/V]/generate`` (one JSON answer) and ``generate_stream``
(server-sent events, one per response: a decoupled model's stream of responses, or
the one answer of any other model). The shaping is ``generate_shaping``'s."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from carpool.errors import CarpoolError, InvalidRequest
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import check_inputs
from carpool.server.generate_shaping import generate_body, generate_inputs
from carpool.server.served import ServedModels
from carpool.server.served_user import ServedUserModel, ServedVersion, one_response
from carpool.server.sse import EventStream
from carpool.server.v2_models import priority_and_timeout

Arrays = dict[str, np.ndarray[Any, Any]]


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/v2/models/{name}/generate")
    @api.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
        served, target, answers = await _answers(models, name, version, request)
        return _body(served, target, await one_response(name, answers))

    @api.post("/v2/models/{name}/generate_stream")
    @api.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(
        name: str, request: Request, version: str | None = None
    ) -> EventStream:
        served, target, answers = await _answers(models, name, version, request)
        try:
            first = await anext(answers)  # a request refused is an HTTP error, not an event
        except StopAsyncIteration:
            first = None
        except BaseException:
            await answers.aclose()
            raise
        return EventStream(_events(served, target, first, answers), sep="\n")

    return api


async def _answers(
    models: ServedModels, name: str, version: str | None, request: Request
) -> tuple[ServedUserModel, ServedVersion, AsyncGenerator[Arrays, None]]:
    if models.builtin(name) is not None:
        raise InvalidRequest(
            f"model '{name}' is a built-in model; the generate extension serves repository "
            "models (use /v1/completions or /v1/embeddings)",
            param="model",
        )
    served = models.user(name)
    target = served.version(version)
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("request body is not valid JSON") from None
    arrays, params = generate_inputs(body, target.spec)
    checked = check_inputs(target.spec, arrays)
    priority, timeout_s = priority_and_timeout(params)
    payload = TensorPayload(
        checked.arrays,
        (),
        request_id=str(body.get("id") or ""),
        parameters={k: v for k, v in params.items() if isinstance(v, str | int | float | bool)},
    )
    answers = served.responses(
        target, checked, payload, priority=priority, timeout_s=timeout_s, request=request
    )
    return served, target, answers


def _body(served: ServedUserModel, target: ServedVersion, outputs: Arrays) -> dict[str, Any]:
    order = [(t.name, outputs[t.name]) for t in target.spec.outputs if t.name in outputs]
    return generate_body(
        served.name, str(target.spec.version), order, target.spec.max_batch_size > 0
    )


async def _events(
    served: ServedUserModel,
    target: ServedVersion,
    first: Arrays | None,
    answers: AsyncGenerator[Arrays, None],
) -> AsyncIterator[dict[str, str]]:
    """The stream's events: each response, or an ``error`` event that ends it."""
    async with contextlib.aclosing(answers):
        try:
            if first is None:
                return
            yield {"data": json.dumps(_body(served, target, first))}
            async for outputs in answers:
                yield {"data": json.dumps(_body(served, target, outputs))}
        except CarpoolError as exc:
            yield {"data": json.dumps({"error": exc.message})}
