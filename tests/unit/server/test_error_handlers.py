"""``errors.handled``: a path answered in front of the app's exception layers gets the
response of the handler registered for the exception's nearest class."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI
from starlette.requests import Request

from carpool.errors import InvalidRequest, ModelNotFound
from carpool.server.http import errors


def answer(exc: Exception) -> tuple[int, dict[str, object]]:
    app = FastAPI()
    errors.install(app)
    path = "/v2/models/m/infer"
    request = Request({"type": "http", "method": "POST", "path": path, "headers": []})
    response = asyncio.run(errors.handled(app.exception_handlers, request, exc))
    return response.status_code, json.loads(bytes(response.body))


def test_a_carpool_error_gets_its_status_and_the_protocols_shape() -> None:
    status, body = answer(InvalidRequest("input 'x' is wrong", param="x"))
    assert status == 400
    assert body == {"error": "input 'x' is wrong"}  # the v2 protocol's shape
    status, body = answer(ModelNotFound("no model 'm'"))
    assert status == 404


def test_an_unexpected_error_is_a_500_without_its_message() -> None:
    status, body = answer(RuntimeError("secret detail"))
    assert status == 500
    assert "secret detail" not in json.dumps(body)
