"""``errors.install``: a route's exception gets the response of the handler registered
for its nearest class, in the shape of the protocol the path speaks."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.testclient import TestClient

from carpool.errors import InvalidRequest, ModelNotFound
from carpool.server.http import errors


def answer(exc: Exception) -> tuple[int, dict[str, object]]:
    app = FastAPI()
    errors.install(app)

    @app.post("/v2/models/m/infer")
    async def infer() -> None:
        raise exc

    response = TestClient(app, raise_server_exceptions=False).post("/v2/models/m/infer")
    return response.status_code, json.loads(response.content)


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
