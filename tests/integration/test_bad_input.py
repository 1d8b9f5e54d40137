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
from schemathesis.checks import not_a_server_error

from tests.integration.conftest import Server, start_server, stop_server

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
    "/v1/embeddings": {"model": EMBED, "input": "hi"},
    "/tokenize": {"model": CHAT, "prompt": "hi"},
    "/detokenize": {"model": CHAT, "tokens": [1, 2]},
    f"/v2/models/{EMBED}/infer": {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]
    },
}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # A short context bounds every request that happens to be valid.
    s = start_server("--max-model-len", "32", "--kv-cache-memory", "64MiB")
    yield s
    assert stop_server(s) == 0


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    assert "Traceback" not in response.text and 'File "' not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert isinstance(message, str) and len(message) > 5, response.text
        if response.status_code == 422:
            assert error["param"], response.text


FIELDS = {
    path: sorted({*body, "n", "stream", "temperature", "priority"}) for path, body in VALID.items()
}


@pytest.mark.parametrize("path", sorted(VALID))
def test_any_field_with_any_value_gets_a_clear_answer(server: Server, path: str) -> None:
    sent = {"count": 0}

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(FIELDS[path]), value=json_values)
    def one(field: str, value: object) -> None:
        body = {**VALID[path], field: value}
        with httpx.Client(base_url=server.url, timeout=60) as c:
            check(c.post(path, json=body))
        sent["count"] += 1

    one()
    assert sent["count"] >= 20


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_body_at_all_gets_a_clear_answer(body: bytes) -> None:
    url = _SERVER_URL["url"]
    with httpx.Client(base_url=url, timeout=60) as c:
        for path in VALID:
            check(c.post(path, content=body, headers={"content-type": "application/json"}))


_SERVER_URL: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _remember_url(server: Server) -> None:
    _SERVER_URL["url"] = server.url


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
