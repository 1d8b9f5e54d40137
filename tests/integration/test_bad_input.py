"""No input may produce a 500 or a stack trace, and every 4xx says what is wrong:
property-based bodies (hypothesis) for every request schema, and schemathesis
against the server's own OpenAPI document."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis.checks import not_a_server_error

from carpool.server.anthropic.messages_schemas import CountTokensRequest, MessagesRequest
from carpool.server.generation.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    V2InferRequest,
)
from carpool.server.responses.responses_schemas import ResponsesRequest
from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.fuzzing import OUTCOMES, check, json_values, send

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"

# Valid bodies for each endpoint; the tests replace or add fields with arbitrary JSON.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": CHAT,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/completions": {"model": CHAT, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": CHAT, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {
        "model": CHAT,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
    "/v1/messages/count_tokens": {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": EMBED, "input": "hi"},
    "/tokenize": {"model": CHAT, "prompt": "hi"},
    "/detokenize": {"model": CHAT, "tokens": [1, 2]},
    f"/v2/models/{EMBED}/infer": {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # A short context bounds every request that happens to be valid.
    s = start_server("--max-model-len", "32", "--kv-cache-memory", "64MiB")
    yield s
    assert stop_server(s) == 0


def still_serving(server: Server) -> None:
    """Healthy, and a normal request gets its usual answer afterwards."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        body = {"model": CHAT, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
        first = c.post("/v1/completions", json=body)
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == BASELINE[0]
        embedded = c.post("/v1/embeddings", json={"model": EMBED, "input": "hi"})
        assert embedded.status_code == 200 and len(embedded.json()["data"][0]["embedding"]) == 384


BASELINE: list[str] = []


SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    f"/v2/models/{EMBED}/infer": V2InferRequest,
}
# Every field of every endpoint's schema, and one that no schema has.
FIELDS = {path: sorted({*SCHEMAS[path].model_fields, "unknown"}) for path in VALID}


@pytest.mark.parametrize("path", sorted(VALID))
def test_any_field_with_any_value_gets_a_clear_answer(server: Server, path: str) -> None:
    sent = {"count": 0}

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(FIELDS[path]), value=json_values)
    def one(field: str, value: object) -> None:
        body = {**VALID[path], field: value}
        check(send(client, path, body))
        sent["count"] += 1

    with httpx.Client(base_url=server.url, timeout=60) as client:  # making one: ~0.05 s
        one()
    assert sent["count"] >= 40
    still_serving(server)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=st.binary(max_size=64)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from([b"[" * d + b"]" * d for d in (500, 990, 5000)])
    | st.sampled_from(
        [b'{"inputs": [{"data": ' + b"[" * d + b"]" * d + b"}]}" for d in (990, 5000)]
    )
)
def test_any_body_at_all_gets_a_clear_answer(body: bytes) -> None:
    """(the campaign's outcomes are printed at the end of the module, with -s)"""
    url = _SERVER_URL["url"]
    with httpx.Client(base_url=url, timeout=60) as c:
        for path in VALID:
            check(c.post(path, content=body, headers={"content-type": "application/json"}))


_SERVER_URL: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _remember_url(server: Server) -> Iterator[None]:
    _SERVER_URL["url"] = server.url
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body = {"model": CHAT, "prompt": "The sky is", "max_tokens": 4, "temperature": 0}
        BASELINE.append(c.post("/v1/completions", json=body).json()["choices"][0]["text"])
    yield
    print(f"\nbad-input campaign: {sum(OUTCOMES.values())} requests, by status {dict(OUTCOMES)}")
    still_serving(server)


@pytest.mark.parametrize("timeout", [5e-324, 1e-40, 1e-6])
def test_a_timeout_too_short_to_wait_still_runs_on_an_idle_server(
    server: Server, timeout: float
) -> None:
    """A deadline only expires a request the server passed by: an idle one starts it."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = send(c, path, {**VALID[path], "max_tokens": 1, "timeout": timeout})
            assert response.status_code == 200, (path, response.text)
        for path in ("/v1/embeddings",):
            response = send(c, path, {**VALID[path], "timeout": timeout})
            assert response.status_code == 200, (path, response.text)
        v2 = {**VALID[f"/v2/models/{EMBED}/infer"], "parameters": {"timeout": 1}}
        response = send(c, f"/v2/models/{EMBED}/infer", v2)
        assert response.status_code == 200, response.text


def test_openapi_operations_never_fail_the_server(server: Server) -> None:
    """schemathesis generates requests for every operation in our OpenAPI document
    (driven directly: its lazy pytest fixture loader does not run on this pytest)."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    calls = {"count": 0}
    for operation in operations:

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def one(case: Any) -> None:
            response = case.call(timeout=60)
            case.validate_response(response, checks=[not_a_server_error])
            assert "Traceback" not in response.text
            calls["count"] += 1

        one()
    assert calls["count"] >= len(operations)
    still_serving(server)
