"""``carpool serve --engine-process``: the chat model's engine in a process of its
own behind the same API. Answers are the in-process engine's, streamed or not; bad
input is refused on the server's side, naming the field; /metrics counts what the
engine did; a request the model fails on fails alone; unloading stops the process
and loading starts a new one; an engine process that dies fails its requests and
the server exits non-zero."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
import tritonclient.http as triton

from carpool import LLM, SamplingParams
from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.conftest import greedy_body as completion

CHAT = "smollm2-135m-instruct"
POISON = 29999  # fails the model when a prompt holds it
KILLER = 29998  # kills the engine's process when a prompt holds it
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    plan = json.dumps({"fail_on_token": POISON, "kill_runtime_on_token": KILLER})
    s = start_server(
        *("--model", CHAT, "--engine-process"),
        *("--kv-cache-memory", "128MiB", "--model-control-mode", "explicit"),
        faults=plan,
    )
    yield s
    if s.process.poll() is None:
        assert stop_server(s) == 0


@pytest.fixture(scope="module")
def in_process() -> list[str]:
    """The greedy answers of the engine in the test's own process."""
    llm = LLM(CHAT)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_answers_are_the_in_process_engines(server: Server, in_process: list[str]) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(
                *(c.post("/v1/completions", json=completion(p, 12)) for p in PROMPTS)
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["text"] for r in responses] == in_process
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in responses)


def test_streamed_pieces_join_into_the_whole_answer(server: Server, in_process: list[str]) -> None:
    body = completion(PROMPTS[0], 12, n=2, stream=True, stream_options={"include_usage": True})
    texts = ["", ""]
    usage = None
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
            usage = event.get("usage") or usage
    assert texts == [in_process[0]] * 2
    assert usage == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}


def test_bad_input_is_refused_naming_the_field(server: Server) -> None:
    """Streamed, so only a check on the server's side (before the stream starts) can
    make it a 400: the engine's own would end a started stream with an error event."""
    schema = {"name": "a", "schema": {"type": "no-such-type"}}
    cases = [
        (completion([5, 60_000], 4, stream=True), "prompt"),
        (completion("hello", 9_000, stream=True), "max_tokens"),
        (completion("hello", 4, stop_token_ids=[60_000], stream=True), "stop_token_ids"),
        (
            {
                "model": CHAT,
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": schema},
                "stream": True,
            },
            "response_format",
        ),
    ]
    with server.client() as c:
        for body, field in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = c.post(path, json=body)
            assert r.status_code == 400, (field, r.text)
            assert r.json()["error"]["param"] == field


def test_metrics_count_what_the_engine_did(server: Server) -> None:
    before = server.metric("carpool_generation_tokens_total", model=CHAT)
    finished = server.metric("carpool_request_success_total", model=CHAT, finished_reason="length")
    with server.client() as c:
        assert c.post("/v1/completions", json=completion("count me", 7)).status_code == 200
    # The engine's statistics come with the step that finished the request.
    assert server.metric("carpool_generation_tokens_total", model=CHAT) == before + 7
    after = server.metric("carpool_request_success_total", model=CHAT, finished_reason="length")
    assert after == finished + 1


def test_a_failing_request_fails_alone(server: Server) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json=completion([5, POISON, 6], 8)),
                *(c.post("/v1/completions", json=completion(p, 12)) for p in PROMPTS),
            )

    bad, *good = asyncio.run(run())
    assert bad.status_code == 500 and "Traceback" not in bad.text
    assert bad.json()["error"]["type"] == "model_error"
    assert [r.status_code for r in good] == [200] * len(PROMPTS)


def test_unloading_stops_the_engine_and_loading_starts_another(
    server: Server, in_process: list[str]
) -> None:
    url = server.url.removeprefix("http://")
    control = triton.InferenceServerClient(url, network_timeout=120)
    control.unload_model(CHAT)
    with server.client() as c:
        assert c.post("/v1/completions", json=completion("x", 2)).status_code == 404
    control.load_model(CHAT)
    with server.client() as c:
        r = c.post("/v1/completions", json=completion(PROMPTS[0], 12))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == in_process[0]


def test_a_dead_engine_fails_its_requests_and_stops_the_server(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json=completion([7, KILLER], 4))
        assert r.status_code == 503 and "Traceback" not in r.text
        assert "engine process" in r.json()["error"]["message"]
        try:  # the very next probe after the failed request
            health = c.get("/health").status_code
        except httpx.TransportError:
            health = None  # already gone: also not healthy
        assert health in (503, None)
    assert server.process.wait(timeout=60) != 0
