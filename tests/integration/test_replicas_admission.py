"""Admission on ``--replicas 2``: overload gives 503 with Retry-After as one process
does, the API key guards the same endpoints, and SIGTERM drains every stream."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.conftest import CHAT, Server, start_server, stop_server

# The single-process cases, collected here against this module's `tight_server`.
from tests.integration.test_generation_api import (  # noqa: F401
    test_api_key_guards_model_endpoints_only,
    test_overload_gets_503_with_retry_after_and_the_rest_complete,
)

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow
KEY = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def tight_server() -> Iterator[Server]:
    # Per replica one sequence runs and at most two wait: the rest are refused at once.
    s = start_server(
        "--replicas",
        "2",
        "--model",
        CHAT,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
        "--kv-cache-memory",
        "64MiB",
        "--api-key",
        "sesame",
        timeout_s=300,
    )
    yield s
    assert stop_server(s) == 0


def test_sigterm_lets_streams_in_flight_finish_refuses_new_ones_and_exits_0(
    tight_server: Server,
) -> None:
    body = {
        "model": CHAT,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    refused = None
    with (
        httpx.Client(base_url=tight_server.url, timeout=120, headers=KEY) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                tight_server.process.send_signal(signal.SIGTERM)
            events.append(line[6:])
            if refused is None and len(events) == 2:
                with httpx.Client(base_url=tight_server.url, timeout=30, headers=KEY) as other:
                    refused = other.post("/v1/completions", json={**body, "stream": False})
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert refused is not None and refused.status_code == 503
    assert int(refused.headers["Retry-After"]) >= 1
    assert tight_server.process.wait(timeout=120) == 0
