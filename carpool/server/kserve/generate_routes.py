"""Triton's generate extension for repository models and generation models: ``POST
/v2/models/NAME[/versions/V]/generate`` (one JSON answer) and ``generate_stream``
(server-sent events, one per response: a decoupled model's stream of responses, a
generation model's steps with ``stream``, or the one answer of any other model). A
generation model takes the tensors of Triton's vLLM backend (``llm_tensors``). The
shaping is ``generate_shaping``'s."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from carpool.errors import CarpoolError, InvalidRequest
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec, check_inputs
from carpool.server.http.sse import EventStream
from carpool.server.kserve.generate_shaping import generate_body, generate_inputs
from carpool.server.kserve.v2_models import (
    GeneratorV2,
    adapter,
    priority_and_timeout,
    scalar_parameters,
)
from carpool.server.registry.served import ServedGenerator, ServedModels
from carpool.server.registry.served_user import one_response

Arrays = dict[str, np.ndarray[Any, Any]]
Shape = Callable[[Arrays], dict[str, Any]]


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.post("/v2/models/{name}/generate")
    @api.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(name: str, request: Request, version: str | None = None) -> dict[str, Any]:
        shape, answers = await _answers(models, name, version, request)
        return shape(await one_response(name, answers))

    @api.post("/v2/models/{name}/generate_stream")
    @api.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(
        name: str, request: Request, version: str | None = None
    ) -> EventStream:
        shape, answers = await _answers(models, name, version, request)
        try:
            first = await anext(answers)  # a request refused is an HTTP error, not an event
        except StopAsyncIteration:
            first = None
        except BaseException:
            await answers.aclose()
            raise
        return EventStream(_events(shape, first, answers), sep="\n")

    return api


async def _answers(
    models: ServedModels, name: str, version: str | None, request: Request
) -> tuple[Shape, AsyncGenerator[Arrays, None]]:
    """How to shape a response of model ``name``, and its responses to ``request``."""
    builtin = models.builtin(name)
    if builtin is not None and not isinstance(builtin, ServedGenerator):
        raise InvalidRequest(
            f"model '{name}' is a built-in embedding model; the generate extension serves "
            "repository models and generation models (use /v1/embeddings)",
            param="model",
        )
    body = await _json(request)
    if isinstance(builtin, ServedGenerator):
        llm = adapter(models, name, lambda: True)
        assert isinstance(llm, GeneratorV2)
        own = llm.version_of(version)
        arrays, params = generate_inputs(body, llm.spec)
        answers = llm.generate(arrays, params)
        return functools.partial(_shaped, llm.name, own, llm.spec, False), answers
    served = models.user(name)
    target = served.version(version)
    arrays, params = generate_inputs(body, target.spec)
    checked = check_inputs(target.spec, arrays)
    priority, timeout_s = priority_and_timeout(params)
    payload = TensorPayload(
        checked.arrays,
        (),
        request_id=str(body.get("id") or ""),
        parameters=scalar_parameters(params),
    )
    answers = served.responses(
        target, checked, payload, priority=priority, timeout_s=timeout_s, request=request
    )
    batched = target.spec.max_batch_size > 0
    return functools.partial(_shaped, name, str(target.spec.version), target.spec, batched), answers


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("request body is not valid JSON") from None


def _shaped(
    name: str, version: str, spec: ModelSpec, batched: bool, outputs: Arrays
) -> dict[str, Any]:
    order = [(t.name, outputs[t.name]) for t in spec.outputs if t.name in outputs]
    return generate_body(name, version, order, batched)


async def _events(
    shape: Shape, first: Arrays | None, answers: AsyncGenerator[Arrays, None]
) -> AsyncIterator[dict[str, str]]:
    """The stream's events: each response, or an ``error`` event that ends it."""
    async with contextlib.aclosing(answers):
        try:
            if first is None:
                return
            yield {"data": json.dumps(shape(first))}
            async for outputs in answers:
                yield {"data": json.dumps(shape(outputs))}
        except CarpoolError as exc:
            yield {"data": json.dumps({"error": exc.message})}
