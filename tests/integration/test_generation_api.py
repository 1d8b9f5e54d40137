"""Text generation over HTTP with the official openai client (sync and async,
streaming and not) against a real server on the built-in chat model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.conftest import Server, start_server, stop_server

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["waiting", "launched"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server twice: with steps that wait, and with each step launched before the
    last one lands (``--async-scheduling``); every test of it passes on both."""
    launched = ["--async-scheduling"] if request.param == "launched" else []
    s = start_server("--max-model-len", "1024", "--kv-cache-memory", "256MiB", *launched)
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models_lists_both_built_in_models(client: openai.OpenAI) -> None:
    assert {m.id for m in client.models.list()} == {CHAT, EMBED}


def test_the_log_says_which_code_runs_each_model_before_the_ready_line(server: Server) -> None:
    ready = next(i for i, line in enumerate(server.log) if "carpool ready on" in line)
    said = {
        line.split(" runs: ")[0].rsplit(" ", 1)[-1]: line.split(" runs: ")[1].strip()
        for line in server.log[:ready]
        if " runs: " in line
    }
    assert said == {
        CHAT: "linear layers: native (quantized_linear on the file's blocks, 121 layers, no "
        "float32 copy); decoder stack: native (llama_stack, one call per step); "
        "decode attention: native (paged_decode_attention)",
        EMBED: "encoder attention: native (ragged_attention)",
    }
    assert not [line for line in server.log[:ready] if " WARNING " in line]


def test_chat_completion_answers_and_counts_tokens(client: openai.OpenAI, server: Server) -> None:
    reply = client.chat.completions.create(
        model=CHAT,
        messages=QUESTION,
        max_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    with server.client() as c:
        prompt = c.post("/tokenize", json={"model": CHAT, "messages": QUESTION}).json()
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == prompt["count"]
    assert 0 < reply.usage.completion_tokens <= 20
    assert reply.usage.total_tokens == prompt["count"] + reply.usage.completion_tokens


def test_length_finish_and_stop_strings(client: openai.OpenAI) -> None:
    short = client.completions.create(model=CHAT, prompt="One, two, three,", max_tokens=1)
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 1
    free = client.completions.create(
        model=CHAT, prompt="One, two, three, four,", max_tokens=12, temperature=0
    )
    text = free.choices[0].text
    assert "," in text.strip()
    stopped = client.completions.create(
        model=CHAT, prompt="One, two, three, four,", max_tokens=12, temperature=0, stop=[","]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(",")]


def test_streamed_chat_matches_the_whole_answer_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=CHAT,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )

    async def stream() -> tuple[str, list[str | None], object]:
        async with openai.AsyncOpenAI(
            base_url=str(client.base_url), api_key="unused", max_retries=0
        ) as c:
            chunks = await c.chat.completions.create(
                model=CHAT,
                messages=QUESTION,  # type: ignore[arg-type]
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, reasons, usage = "", [], None
            async for chunk in chunks:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    reasons.append(choice.finish_reason)
                if chunk.usage is not None:
                    usage = chunk.usage
            return text, reasons, usage

    text, reasons, usage = asyncio.run(stream())
    assert text == whole.choices[0].message.content
    assert [r for r in reasons if r] == [whole.choices[0].finish_reason]
    assert usage == whole.usage


def test_seeded_sampling_repeats_and_n_gives_distinct_choices(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        reply = client.completions.create(
            model=CHAT,
            prompt="My favourite animal is",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=3,
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        return [c.text for c in reply.choices]

    first = sample(42)
    assert sample(42) == first
    assert len(set(first)) > 1
    assert sample(43) != first


def test_logprobs_in_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=CHAT,
        messages=QUESTION,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    completion = client.completions.create(
        model=CHAT, prompt="Hello", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 3
    assert all(len(top) == 2 for top in logprobs.top_logprobs or [])
    assert "".join(logprobs.tokens or []) == completion.choices[0].text


def test_tokenize_and_detokenize_round_trip(server: Server) -> None:
    with server.client() as c:
        tokens = c.post("/tokenize", json={"model": CHAT, "prompt": "Héllo 🚗 world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
        text = c.post("/detokenize", json={"model": CHAT, "tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Héllo 🚗 world"


def test_concurrent_streams_share_engine_steps(server: Server) -> None:
    steps_before = server.metric("carpool_engine_steps_total", model=CHAT)
    launched_before = server.metric("carpool_engine_launched_steps_total", model=CHAT)
    tokens_before = server.metric("carpool_generation_tokens_total", model=CHAT)

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": CHAT,
            "prompt": f"Story number {i}:",
            "max_tokens": 12,
            "ignore_eos": True,
            "stream": True,
        }
        pieces = 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += 1
        return pieces

    async def all_of_them() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return list(await asyncio.gather(*(one(c, i) for i in range(8))))

    assert all(p >= 1 for p in asyncio.run(all_of_them()))
    steps = server.metric("carpool_engine_steps_total", model=CHAT) - steps_before
    tokens = server.metric("carpool_generation_tokens_total", model=CHAT) - tokens_before
    assert tokens == 8 * 12
    # Alone, each token would need its own step: 96 steps. Shared, far fewer.
    assert steps < tokens / 2
    launched = server.metric("carpool_engine_launched_steps_total", model=CHAT) - launched_before
    if "--async-scheduling" in server.process.args:
        assert launched >= steps / 2
    else:
        assert launched == 0


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server: Server) -> None:
    body = {
        "model": CHAT,
        "prompt": "Count to a thousand:",
        "max_tokens": 900,
        "stream": True,
        "ignore_eos": True,
    }
    aborted_before = (
        server.metric("carpool_request_success_total", model=CHAT, finished_reason="abort")
        if _has_abort(server)
        else 0.0
    )
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.metric("carpool_num_requests_running", model=CHAT) == 1
    # The connection is closed: the request is aborted at the engine's next step.
    wait_for(lambda: server.metric("carpool_num_requests_running", model=CHAT) == 0)
    assert server.metric("carpool_kv_cache_usage_perc", model=CHAT) == 0
    assert (
        server.metric("carpool_request_success_total", model=CHAT, finished_reason="abort")
        == aborted_before + 1
    )


def _has_abort(server: Server) -> bool:
    try:
        server.metric("carpool_request_success_total", model=CHAT, finished_reason="abort")
    except KeyError:
        return False
    return True


def wait_for(condition: object, timeout_s: float = 30.0) -> None:
    """Poll ``condition`` until it holds (the server's state, observed, not slept on)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": QUESTION}, 404, "model"),
        ({"model": CHAT, "messages": []}, 400, "messages"),
        ({"model": CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ({"model": CHAT, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": CHAT, "messages": QUESTION, "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": CHAT, "messages": QUESTION, "n": 100}, 400, "n"),
        ({"model": CHAT, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
        ({"model": EMBED, "messages": QUESTION}, 400, "model"),
        ({"model": CHAT, "messages": [{"role": "user", "content": "word " * 1100}]}, 400, "prompt"),
    ],
)
def test_bad_chat_requests_get_a_4xx_naming_the_field(
    server: Server, body: dict[str, object], status: int, param: str
) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == status
    assert param in error["message"] or param in ("model", "prompt")
    assert "Traceback" not in r.text


def test_malformed_json_is_a_400(server: Server) -> None:
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_errors_mid_setup_use_openais_shape_for_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=QUESTION)  # type: ignore[arg-type]
    assert "nope" in str(info.value)


@pytest.fixture(scope="module")
def tight_server() -> Iterator[Server]:
    # One sequence runs at a time and at most two wait: the rest are refused at once.
    s = start_server(
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
    )
    yield s
    assert stop_server(s) == 0


def test_overload_gets_503_with_retry_after_and_the_rest_complete(tight_server: Server) -> None:
    headers = {"Authorization": "Bearer sesame"}
    body = {"model": CHAT, "prompt": "Paris is", "max_tokens": 6, "temperature": 0}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tight_server.url, timeout=120, headers=headers) as c:
            return list(
                await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(10)))
            )

    responses = asyncio.run(burst())
    refused = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(accepted) == 10
    assert refused and accepted
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    texts = {r.json()["choices"][0]["text"] for r in accepted}
    assert len(texts) == 1  # greedy: every accepted request got the same, full answer
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in accepted)


def test_api_key_guards_model_endpoints_only(tight_server: Server) -> None:
    body = {"model": CHAT, "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=tight_server.url, timeout=60) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models").status_code == 401
        assert c.post("/tokenize", json={"model": CHAT, "prompt": "x"}).status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/v2/health/ready").status_code == 200


def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0() -> None:
    s = start_server("--model", CHAT, "--kv-cache-memory", "64MiB")
    body = {
        "model": CHAT,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    events = []
    try:
        with (
            httpx.Client(base_url=s.url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    s.process.send_signal(__import__("signal").SIGTERM)
                events.append(line[6:])
    finally:
        code = s.process.wait(timeout=60)
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert code == 0
