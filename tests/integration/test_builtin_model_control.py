"""The built-in models (``--model``) under Triton's model control: listed in the
repository index, unloaded while streams run (they finish; new requests get 503
then 404) and loaded again to the same answers (issue 26)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import (
    CHAT,
    MODEL,
    Server,
    greedy_body,
    start_server,
    stop_server,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--model", CHAT, "--model", MODEL, "--model-control-mode", "explicit")
    yield s
    assert stop_server(s) == 0


def control(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120)


def index(server: Server) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in control(server).get_model_repository_index()}


def complete(h: httpx.Client, max_tokens: int = 8) -> httpx.Response:
    return h.post("/v1/completions", json=greedy_body("Once upon a time", max_tokens))


def test_built_in_models_are_in_the_index(server: Server) -> None:
    entries = index(server)
    assert entries[CHAT]["state"] == entries[MODEL]["state"] == "READY"
    assert entries[CHAT]["version"] == "1"
    c = control(server)
    with pytest.raises(InferenceServerException) as unknown:
        c.unload_model("no-such-model")
    assert unknown.value.status() == "400"
    assert "no --model-repository" in unknown.value.message()


def test_unloading_a_generator_finishes_its_streams_then_it_is_gone(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as h:
        before = complete(h).json()["choices"][0]["text"]
        body = greedy_body(
            "Once upon a time", 150, stream=True, stream_options={"include_usage": True}
        )
        with h.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
            unloading = threading.Thread(target=control(server).unload_model, args=(CHAT,))
            unloading.start()
            while index(server)[CHAT]["state"] != "UNLOADING":
                pass
            refused = complete(h)
            assert refused.status_code == 503, refused.text
            assert "retry-after" in refused.headers
            assert "unloading" in refused.json()["error"]["message"]
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        finals = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        reasons = [c["finish_reason"] for f in finals for c in f["choices"]]
        assert reasons[-1] == "length"
        assert finals[-1]["usage"]["completion_tokens"] == 150
        unloading.join()
        gone = complete(h)
        assert gone.status_code == 404, gone.text
        entry = index(server)[CHAT]
        assert entry["state"] == "UNAVAILABLE" and entry["reason"] == "unloaded"
        assert CHAT not in [m["id"] for m in h.get("/v1/models").json()["data"]]
        embedded = h.post("/v1/embeddings", json={"model": MODEL, "input": "still here"})
        assert embedded.status_code == 200  # the other model serves throughout

        control(server).load_model(CHAT)
        assert index(server)[CHAT]["state"] == "READY"
        assert complete(h).json()["choices"][0]["text"] == before


def test_an_embedder_unloads_and_loads_again(server: Server) -> None:
    body = {"model": MODEL, "input": ["a cat", "a dog"]}
    with httpx.Client(base_url=server.url, timeout=120) as h:
        before = h.post("/v1/embeddings", json=body).json()["data"]
        c = control(server)
        c.unload_model(MODEL)
        assert h.post("/v1/embeddings", json=body).status_code == 404
        assert h.get(f"/v2/models/{MODEL}/ready").status_code == 404
        assert h.get("/v2/models/stats").status_code == 200
        c.load_model(MODEL)
        c.load_model(MODEL)  # loading a loaded built-in changes nothing
        after = h.post("/v1/embeddings", json=body).json()["data"]
        assert [d["embedding"] for d in after] == [d["embedding"] for d in before]
        assert c.is_model_ready(MODEL)


def test_control_needs_explicit_mode() -> None:
    s = start_server("--model", MODEL)
    try:
        with pytest.raises(InferenceServerException) as refused:
            control(s).unload_model(MODEL)
        assert refused.value.status() == "400"
        assert "explicit" in refused.value.message()
        assert index(s)[MODEL]["state"] == "READY"
    finally:
        assert stop_server(s) == 0
