"""A hostile client against a real ``carpool serve`` with the real clients: one test
per class of bad input. Each asserts the exact status, that requests in flight
beside it finish correctly, and that the server still answers a normal request
with the right answer afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import Server, rss_bytes, start_server, stop_server
from tests.integration.conftest import greedy_body as greedy

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
MAX_WAITING = 8  # so one request may bring at most 4 prompts
QUEUE = 64  # so one embeddings request may bring at most 32 inputs
BODY_LIMIT = 16 * 2**20  # room for the 7 MB prompts below (the default is 2 MiB)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(
        "--max-waiting-requests",
        str(MAX_WAITING),
        "--max-queue-size",
        str(QUEUE),
        "--kv-cache-memory",
        "64MiB",
        "--max-body-bytes",
        str(BODY_LIMIT),
    )
    yield s
    assert stop_server(s) == 0


def raw(body: dict[str, Any]) -> bytes:
    """JSON with ASCII escapes: lone surrogates travel as ``\\ud800``, as any client's
    JSON may send them (httpx's own encoder refuses them)."""
    return json.dumps(body).encode()


async def post(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await c.post(path, content=raw(body), headers={"content-type": "application/json"})


def still_serving(server: Server, solo_text: str) -> None:
    """Healthy, and a normal request gets the answer it got before."""
    with server.client() as c:
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", json=greedy("The sky is"))
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == solo_text


@pytest.fixture(scope="module")
def solo(server: Server) -> str:
    with server.client() as c:
        text: str = c.post("/v1/completions", json=greedy("The sky is")).json()["choices"][0][
            "text"
        ]
    return text


def hostile_beside_neighbours(
    server: Server, path: str, body: dict[str, Any]
) -> tuple[httpx.Response, list[str]]:
    """Send ``body`` while three streams are in flight; its response and the
    neighbours' streamed texts."""

    async def run() -> tuple[httpx.Response, list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")

        async def neighbour() -> str:
            stream = await client.completions.create(
                model=CHAT,
                prompt="The sky is",
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.ensure_future(neighbour()) for _ in range(3)]
            hostile = await post(c, path, body)
            return hostile, list(await asyncio.gather(*tasks))

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("temperature", 1e309),
        ("priority", 2**70),
        # Checked at every token, each against the held text: capped in count and length.
        ("stop", [f"stop{i}" for i in range(17)]),
        ("stop", "a" * 257),
    ],
)
def test_values_past_their_range_are_refused_and_neighbours_finish(
    server: Server, solo: str, field: str, value: object
) -> None:
    hostile, neighbours = hostile_beside_neighbours(
        server, "/v1/completions", greedy("hi", **{field: value})
    )
    assert hostile.status_code == 400, hostile.text
    assert hostile.json()["error"]["param"] == field
    assert neighbours == [solo] * 3
    still_serving(server, solo)


def test_the_widest_values_in_range_are_served(server: Server, solo: str) -> None:
    with server.client() as c:
        for seed in (2**63 - 1, -(2**63)):
            r = c.post("/v1/completions", json=greedy("hi", seed=seed, n=2, temperature=1))
            assert r.status_code == 200, r.text
        # 1e-40 is 0 in float32: below 1e-5 a temperature is greedy.
        tiny = c.post("/v1/completions", json={**greedy("The sky is"), "temperature": 1e-40})
        assert tiny.json()["choices"][0]["text"] == solo
        vocab = c.post("/tokenize", json={"model": CHAT, "prompt": "x"}).json()
        assert vocab["count"] == 1
        ids = c.post("/v1/completions", json=greedy("hi", stop_token_ids=[49152]))
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "stop_token_ids"
        for ids in ([1, 49152], [1, -1]):
            over = c.post("/v1/completions", json={**greedy("x"), "prompt": ids})
            assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
        negative = c.post("/detokenize", json={"model": CHAT, "tokens": [1, -1]})
        assert negative.status_code == 400 and negative.json()["error"]["param"] == "tokens"
        embed = c.post("/v1/embeddings", json={"model": EMBED, "input": [101, -1, 102]})
        assert embed.status_code == 400 and embed.json()["error"]["param"] == "input"
    still_serving(server, solo)


LONE = "caf\ud800e"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", greedy(LONE), "prompt"),
        ("/v1/completions", greedy("ok", stop=["x", LONE]), "stop"),
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": LONE}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}],
            },
            "messages",
        ),
        ("/v1/responses", {"model": CHAT, "input": LONE}, "input"),
        (
            "/v1/responses",
            {
                "model": CHAT,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}],
            },
            "input",
        ),
        (
            "/v1/messages",
            {"model": CHAT, "max_tokens": 4, "messages": [{"role": "user", "content": LONE}]},
            "messages",
        ),
        ("/v1/embeddings", {"model": EMBED, "input": ["fine", LONE]}, "input"),
        ("/v1/embeddings", {"model": LONE, "input": "fine"}, "model"),
        ("/tokenize", {"model": CHAT, "prompt": LONE}, "prompt"),
        (
            f"/v2/models/{EMBED}/infer",
            {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [LONE]}]},
            None,
        ),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(
    server: Server, solo: str, path: str, body: dict[str, Any], param: str | None
) -> None:
    hostile, neighbours = hostile_beside_neighbours(server, path, body)
    assert hostile.status_code == 400, hostile.text
    error = hostile.json()["error"]
    if path.startswith("/v2"):
        assert "Unicode" in error
    elif path.startswith("/v1/messages"):  # Anthropic's shape: the message names the field
        assert hostile.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert param is not None and param in error["message"] and "Unicode" in error["message"]
    else:
        assert error["param"] == param and "Unicode" in error["message"]
    assert neighbours == [solo] * 3
    still_serving(server, solo)


def test_a_lone_surrogate_as_raw_utf8_bytes_gets_400(server: Server, solo: str) -> None:
    """Python's JSON parser reads a UTF-8-encoded surrogate too (``surrogatepass``)."""
    body = json.dumps(greedy(LONE), ensure_ascii=False).encode("utf-8", "surrogatepass")
    with server.client() as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    still_serving(server, solo)


def test_a_request_bigger_than_a_queue_is_413_and_refuses_nobody_else(
    server: Server, solo: str
) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            too_many_inputs = await post(
                c, "/v1/embeddings", {"model": EMBED, "input": ["a"] * (QUEUE // 2 + 1)}
            )
            too_many_prompts = await post(
                c, "/v1/completions", greedy("x") | {"prompt": ["a"] * (MAX_WAITING // 2 + 1)}
            )
            small = await asyncio.gather(
                post(c, "/v1/embeddings", {"model": EMBED, "input": ["a"] * (QUEUE // 2)}),
                post(c, "/v1/completions", greedy("x") | {"prompt": ["a"] * (MAX_WAITING // 2)}),
                post(c, "/v1/embeddings", {"model": EMBED, "input": "neighbour"}),
            )
            return [too_many_inputs, too_many_prompts, *small]

    inputs, prompts, *small = asyncio.run(run())
    assert (
        inputs.status_code == 413 and f"at most {QUEUE // 2}" in inputs.json()["error"]["message"]
    )
    assert prompts.status_code == 413
    assert f"at most {MAX_WAITING // 2}" in prompts.json()["error"]["message"]
    assert "Retry-After" not in inputs.headers and "Retry-After" not in prompts.headers
    assert [r.status_code for r in small] == [200, 200, 200]
    assert len(small[0].json()["data"]) == QUEUE // 2
    still_serving(server, solo)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", greedy("hello world " * 600_000)),
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": "hello world " * 600_000}]},
        ),
        ("/v1/embeddings", {"model": EMBED, "input": "hello world " * 600_000}),
        ("/v1/responses", {"model": CHAT, "input": "hello world " * 600_000}),
        # Sparse in tokens: megabytes of spaces were tokenized whole (seconds each).
        ("/v1/completions", greedy("hi" + " " * 1_900_000)),
        ("/v1/responses", {"model": CHAT, "input": "hi" + " " * 1_900_000}),
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": "hi" + " " * 1_900_000}]},
        ),
        (
            "/v1/messages",
            {
                "model": CHAT,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello world " * 600_000}],
            },
        ),
    ],
)
def test_a_multi_megabyte_prompt_is_refused_without_tokenizing_it_all(
    server: Server, solo: str, path: str, body: dict[str, Any]
) -> None:
    """Tokenized whole, 7 MB of text made 1.2M tokens and grew the server by GBs."""
    before = rss_bytes(server)
    hostile, neighbours = hostile_beside_neighbours(server, path, body)
    assert hostile.status_code == 400, hostile.text
    assert "maximum" in hostile.json()["error"]["message"]
    assert rss_bytes(server) - before < 300 * 2**20
    assert neighbours == [solo] * 3
    still_serving(server, solo)


def test_the_generation_model_answers_tritons_model_routes(server: Server, solo: str) -> None:
    """tritonclient's model calls work for the LLM as the repository index lists it."""
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert index[CHAT] == "READY"
    assert client.is_model_ready(CHAT)
    meta = client.get_model_metadata(CHAT)
    assert meta["name"] == CHAT and {t["name"] for t in meta["inputs"]} >= {"text_input"}
    assert client.get_model_config(CHAT)["max_batch_size"] == 0
    with server.client() as c:
        c.post("/v1/completions", json=greedy("count me"))
    stats = client.get_inference_statistics(CHAT)["model_stats"][0]
    assert stats["name"] == CHAT and stats["inference_count"] >= 1
    assert not client.is_model_ready(CHAT, model_version="2")
    with pytest.raises(InferenceServerException) as wrong:
        client.get_model_metadata(CHAT, model_version="2")
    assert "version" in wrong.value.message()
    # Its tensors are Triton's vLLM backend's: the prompt, then its completion.
    one = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["The sky is"]}
    params = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with server.client() as c:
        tensors = c.post(f"/v2/models/{CHAT}/infer", json={"inputs": [one], "parameters": params})
        streamed = c.post(
            f"/v2/models/{CHAT}/infer",
            json={"inputs": [one, {**one, "name": "stream", "datatype": "BOOL", "data": [True]}]},
        )
    assert tensors.status_code == 200, tensors.text
    assert tensors.json()["outputs"][0]["data"] == ["The sky is" + solo]
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]


def test_the_openai_contract(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert client.models.retrieve(CHAT).id == CHAT
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    prompt = "The capital of France"
    plain = client.completions.create(model=CHAT, prompt=prompt, max_tokens=4, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=CHAT, prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True
        )
    )
    assert streamed == prompt + plain.choices[0].text
    echoed = client.completions.create(
        model=CHAT, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    assert choice.logprobs is not None
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert tokens is not None and offsets is not None and choice.logprobs.token_logprobs
    assert len(tokens) == 4 + 4  # "The capital of France": 4 prompt tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert [choice.text[o : o + len(t)] for t, o in zip(tokens, offsets, strict=True)] == tokens
    with server.client() as c:
        strict = c.post("/v1/completions", json=greedy("hi") | {"stream": "yes"})
        assert strict.status_code == 400 and strict.json()["error"]["param"] == "stream"
        untyped = c.post("/v1/completions", content=json.dumps(greedy("hi")))
        assert untyped.status_code == 400
        assert "Content-Type: application/json" in untyped.json()["error"]["message"]
