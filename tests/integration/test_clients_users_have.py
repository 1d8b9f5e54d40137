"""The clients users already run against TGI, TEI and OpenAI, unchanged:
huggingface_hub's ``InferenceClient`` pointed at a real server's TGI and TEI routes,
and the openai SDK sending every parameter its request types define (values
generated from the SDK's own type hints, so a parameter the SDK adds is sent too)."""

from __future__ import annotations

import collections.abc
import concurrent.futures
import inspect
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import typing_extensions
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError
from openai.types.chat import completion_create_params
from openai.types.responses import response_create_params

from tests.integration.conftest import CHAT, MODEL, Server, start_server, stop_server, wait_for

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server("--max-model-len", "1024", "--kv-cache-memory", "256MiB")
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def tgi(server: Server) -> InferenceClient:
    return InferenceClient(model=server.url)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


# --- TGI ------------------------------------------------------------------------------


def test_tgi_text_generation_is_greedy_by_default_and_matches_completions(
    tgi: InferenceClient, server: Server
) -> None:
    text = tgi.text_generation(PROMPT, max_new_tokens=8)
    same = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": CHAT, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
    ).json()["choices"][0]["text"]
    assert isinstance(text, str) and text == same and text


def test_tgi_details_carry_tokens_logprobs_prefill_and_top_tokens(tgi: InferenceClient) -> None:
    out = tgi.text_generation(
        PROMPT, max_new_tokens=5, details=True, decoder_input_details=True, top_n_tokens=2
    )
    details = out.details
    assert details is not None
    assert details.finish_reason == "length" and details.generated_tokens == 5
    assert "".join(t.text for t in details.tokens) == out.generated_text
    assert all(t.logprob <= 0 and not t.special for t in details.tokens)
    assert details.prefill[0].logprob is None and len(details.prefill) > 3
    assert all(p.logprob is not None for p in details.prefill[1:])
    assert details.top_tokens is not None and len(details.top_tokens) == 5
    # The chosen token is the best of the top two (greedy).
    assert details.top_tokens[0][0]["id"] == details.tokens[0].id


def test_tgi_stream_yields_each_token_and_ends_with_the_text_and_details(
    tgi: InferenceClient,
) -> None:
    whole = tgi.text_generation(PROMPT, max_new_tokens=6)
    pieces = list(tgi.text_generation(PROMPT, max_new_tokens=6, stream=True))
    assert len(pieces) == 6 and "".join(pieces) == whole
    events = list(tgi.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert [e.details for e in events[:-1]] == [None] * 5
    last = events[-1]
    assert last.generated_text == whole
    assert last.details.finish_reason == "length" and last.details.generated_tokens == 6
    assert last.details.input_length > 3


def test_tgi_stop_sequence_ends_the_text_and_says_so(tgi: InferenceClient) -> None:
    whole = tgi.text_generation(PROMPT, max_new_tokens=8)
    stop = whole[len(whole) // 2 :][:3]
    out = tgi.text_generation(PROMPT, max_new_tokens=8, stop=[stop], details=True)
    assert out.details.finish_reason == "stop_sequence"
    assert stop not in out.generated_text and whole.startswith(out.generated_text)


def test_tgi_seeded_sampling_repeats_and_grammar_constrains(tgi: InferenceClient) -> None:
    sampled = [
        tgi.text_generation("Say", max_new_tokens=8, do_sample=True, temperature=1.5, seed=7)
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    answer = tgi.text_generation(
        "Give a city as JSON:", max_new_tokens=30, grammar={"type": "json", "value": schema}
    )
    assert set(json.loads(answer)) == {"city"}


def test_tgi_errors_are_its_validation_errors(tgi: InferenceClient, server: Server) -> None:
    with pytest.raises(ValidationError, match="max_new_tokens"):
        tgi.text_generation(PROMPT, max_new_tokens=0)
    bad = httpx.post(
        f"{server.url}/generate", json={"inputs": PROMPT, "parameters": {"typical_p": 0.5}}
    )
    assert bad.status_code == 422
    assert bad.json() == {
        "error": "typical decoding is not supported; use top_p or min_p",
        "error_type": "validation",
    }
    stream = httpx.post(
        f"{server.url}/generate_stream",
        json={"inputs": PROMPT, "parameters": {"decoder_input_details": True}},
    )
    assert stream.status_code == 422 and "decoder_input_details" in stream.json()["error"]


def test_tgi_compat_route_answers_a_list_and_info_describes_the_model(server: Server) -> None:
    answer = httpx.post(
        f"{server.url}/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    )
    assert answer.status_code == 200 and list(answer.json()[0]) == ["generated_text"]
    info = httpx.get(f"{server.url}/info").json()
    assert info["model_id"] == CHAT and info["max_total_tokens"] == 1024
    assert httpx.get(f"{server.url}/info", params={"model": MODEL}).json()["model_type"] == {
        "embedding": {"pooling": "mean"}
    }


# --- TEI ------------------------------------------------------------------------------


def test_tei_feature_extraction_matches_openai_embeddings(
    server: Server, client: openai.OpenAI
) -> None:
    tei = InferenceClient(model=f"{server.url}/embed")
    one = tei.feature_extraction("hello world")
    two = tei.feature_extraction(["hello world", "good night"], truncate=True)
    openai_vector = client.embeddings.create(model=MODEL, input="hello world").data[0].embedding
    assert one.shape == (1, 384) and two.shape == (2, 384)
    assert np.allclose(one[0], openai_vector, atol=1e-5) and np.allclose(two[0], one[0], atol=1e-5)
    assert np.isclose(np.linalg.norm(two[1]), 1.0, atol=1e-4)
    cut = tei.feature_extraction("hello world", dimensions=64)
    assert cut.shape == (1, 64) and np.isclose(np.linalg.norm(cut), 1.0, atol=1e-4)


def test_tei_sentence_similarity_ranks_the_close_sentence_first(server: Server) -> None:
    tei = InferenceClient(model=f"{server.url}/similarity")
    near, far = tei.sentence_similarity(
        "a cat sleeps", ["a kitten is sleeping", "stock prices fell"]
    )
    assert 0 < far < near <= 1.0


def test_tei_decode_gives_the_text_back(server: Server) -> None:
    # all-MiniLM's vocabulary: [CLS] hello world [SEP]
    ids = [101, 7592, 2088, 102]
    one = httpx.post(f"{server.url}/decode", json={"ids": ids})
    assert one.status_code == 200 and one.json() == ["hello world"]
    both = httpx.post(
        f"{server.url}/decode", json={"ids": [ids, ids[1:2]], "skip_special_tokens": False}
    )
    assert both.json() == ["[CLS] hello world [SEP]", "hello"]
    outside = httpx.post(f"{server.url}/decode", json={"ids": [10**9]})
    assert outside.status_code == 422 and "vocabulary" in outside.json()["error"]


def test_tei_embed_all_gives_each_tokens_state(server: Server) -> None:
    pooled = httpx.post(f"{server.url}/embed", json={"inputs": ["hello world", "good night"]})
    states = httpx.post(f"{server.url}/embed_all", json={"inputs": ["hello world", "good night"]})
    assert states.status_code == 200
    tokens = [np.asarray(s) for s in states.json()]
    assert [t.shape for t in tokens] == [(4, 384), (4, 384)]  # [CLS] w w [SEP]
    for t, vector in zip(tokens, pooled.json(), strict=True):
        mean = t.mean(axis=0)
        assert np.allclose(mean / np.linalg.norm(mean), vector, atol=1e-5)


def test_tokenize_answers_teis_body_and_vllms(server: Server) -> None:
    tei = httpx.post(f"{server.url}/tokenize", json={"inputs": "hello world"}).json()
    assert tei == [
        [
            {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
            {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5},
            {"id": 2088, "text": "world", "special": False, "start": 6, "stop": 11},
            {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None},
        ]
    ]
    bare = httpx.post(
        f"{server.url}/tokenize", json={"inputs": ["hi", "a b"], "add_special_tokens": False}
    ).json()
    assert [[t["text"] for t in row] for row in bare] == [["hi"], ["a", "b"]]
    vllm = httpx.post(f"{server.url}/tokenize", json={"model": CHAT, "prompt": "Hi"}).json()
    assert vllm["count"] == len(vllm["tokens"]) > 0
    for body, field in [({"inputs": 3}, "inputs"), ({"model": CHAT, "prompt": 3}, "prompt")]:
        refused = httpx.post(f"{server.url}/tokenize", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_tei_errors_are_its_shape_and_name_the_field(server: Server) -> None:
    bad = httpx.post(f"{server.url}/embed", json={"inputs": "x", "prompt_name": "query"})
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"
    assert "prompt_name" not in bad.json() and "query" in bad.json()["error"]
    empty = httpx.post(f"{server.url}/embed", json={"inputs": []})
    assert empty.status_code == 422 and "inputs" in empty.json()["error"]


# --- OpenAI: every parameter of the SDK's request types --------------------------------


def valid_value(hint: Any) -> Any:
    """A value of type ``hint`` (an SDK parameter's annotation): a Literal's first
    member, a TypedDict with its required keys, the first member of a union that is
    not None."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, types.UnionType):
        return valid_value(next(a for a in args if a is not type(None)))
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence):
        return [valid_value(args[0])]
    if origin is dict:
        return {"key": valid_value(args[1])}
    if typing_extensions.is_typeddict(hint):
        hints = typing.get_type_hints(hint)
        return {k: valid_value(hints[k]) for k in hint.__required_keys__}
    if hint is typing.Any or hint is object:
        return "x"
    return {str: "x", int: 1, float: 0.5, bool: False}[hint]


def every_parameter(typed: Any, method: Any, chosen: dict[str, Any]) -> dict[str, Any]:
    """A value for every body parameter of the SDK ``method``: ``chosen`` where the
    test picks one, else generated from ``typed``'s annotation of it."""
    hints = typing.get_type_hints(typed)
    body = {}
    for name in inspect.signature(method).parameters:
        if name in ("extra_headers", "extra_query", "extra_body", "timeout"):
            continue  # the HTTP call's own options, not body fields
        body[name] = chosen[name] if name in chosen else valid_value(hints[name])
    return body


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}

CHAT_CHOICES: dict[str, Any] = {
    "model": CHAT,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "n": 1,
    "stream": False,
    "stream_options": None,
    "tools": [WEATHER_TOOL],
    "tool_choice": "none",
    "functions": None,  # the deprecated form of tools: sent on their own below
    "function_call": None,
    "logit_bias": {"1": -1},
    "modalities": ["text"],
    "response_format": {"type": "text"},
    "temperature": 0,
    "top_p": 1,
    "top_logprobs": 2,
    "logprobs": True,
    "seed": 3,
    "stop": ["\n\n"],
    "service_tier": "flex",
}


def test_chat_accepts_every_parameter_of_the_sdk(client: openai.OpenAI) -> None:
    method = client.chat.completions.create
    body = every_parameter(
        completion_create_params.CompletionCreateParamsBase, method, CHAT_CHOICES
    )
    reply = method(**{k: v for k, v in body.items() if v is not None})
    assert reply.choices[0].finish_reason == "length" and reply.service_tier == "flex"
    message = reply.choices[0].message
    assert message.reasoning_content is None and message.reasoning is None  # always present
    assert len(reply.choices[0].logprobs.content) == 4


def test_chat_reads_functions_as_tools(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        functions=[WEATHER_TOOL["function"]],
        function_call={"name": "get_weather"},
        max_tokens=120,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments), dict
    )


def test_chat_stream_deltas_always_carry_the_reasoning_keys(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas and all(d.reasoning_content is None and d.reasoning is None for d in deltas)


def test_an_assistant_message_may_carry_its_reasoning_back(client: openai.OpenAI) -> None:
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "assistant", "content": "Again.", "reasoning": "Once more."},
        {"role": "user", "content": "Bye"},
    ]
    reply = client.chat.completions.create(model=CHAT, messages=history, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_vllms_guided_fields_constrain_the_reply(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert chat.choices[0].message.content in ("yes", "no")
    digits = client.completions.create(
        model=CHAT, prompt="A number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(digits.choices[0].text) == 3 and digits.choices[0].text.isdigit()
    # Repeated choices are one (a fuzzed list of 2,000 once overflowed the grammar).
    same = client.completions.create(
        model=CHAT, prompt="Say", max_tokens=2, extra_body={"guided_choice": ["ok"] * 1024}
    )
    assert same.choices[0].text == "ok"
    with pytest.raises(openai.BadRequestError, match="guided_choice"):
        client.completions.create(
            model=CHAT, prompt="Say", max_tokens=2, extra_body={"guided_choice": ["ok"] * 1025}
        )
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=CHAT, prompt="Say", max_tokens=2, extra_body={"guided_regex": "[a-"}
        )
    assert caught.value.body["param"] == "guided_regex"  # type: ignore[index]


def test_a_structural_tag_is_accepted_as_vllm_documents_it(client: openai.OpenAI) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<function=get_weather>",
                "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
    reply = client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "Weather in Boston? Write <function="}],
        max_tokens=12,
        response_format=tag,  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={**tag, "triggers": ["<tool="]},  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "response_format"  # type: ignore[index]


def test_a_batch_of_conversations_answers_each_as_its_own_chat(
    client: openai.OpenAI, server: Server
) -> None:
    # What vLLM's batched_chat_completions example does: conversations in one body,
    # plain, constrained by a regex, and by a JSON schema.
    questions = ["Is the sky blue?", "Is fire cold?"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    alone = [
        client.chat.completions.create(model=CHAT, messages=c, max_tokens=6, temperature=0)
        .choices[0]
        .message.content
        for c in conversations
    ]
    url = f"{server.url}/v1/chat/completions/batch"
    body = {"model": CHAT, "messages": conversations, "max_tokens": 6, "temperature": 0}
    plain = httpx.post(url, json=body).json()
    assert [c["index"] for c in plain["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in plain["choices"]] == alone
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] == 12
    regex = httpx.post(url, json={**body, "structured_outputs": {"regex": "(yes|no)"}}).json()
    assert all(c["message"]["content"] in ("yes", "no") for c in regex["choices"])
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}},
        "required": ["name"],
        "additionalProperties": False,
    }
    shaped = httpx.post(
        url,
        json={
            **body,
            "max_tokens": 40,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "strict": True, "schema": schema},
            },
        },
    ).json()
    assert [set(json.loads(c["message"]["content"])) for c in shaped["choices"]] == [{"name"}] * 2
    for field, value in [("stream", True), ("messages", [[]]), ("messages", [])]:
        refused = httpx.post(url, json={**body, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_vllms_pooling_route_gives_the_embedders_vectors(
    server: Server, client: openai.OpenAI
) -> None:
    # What vLLM's openai_pooling_client example sends, pointed at an embedder.
    pooled = httpx.post(
        f"{server.url}/pooling", json={"model": MODEL, "input": "vLLM is great!"}
    ).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    same = client.embeddings.create(model=MODEL, input="vLLM is great!").data[0].embedding
    assert np.allclose(pooled["data"][0]["data"], same, atol=1e-6)
    assert pooled["usage"]["prompt_tokens"] > 0
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "vLLM is great!"}]}
    refused = httpx.post(f"{server.url}/pooling", json=chat)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_tokens_in_tokens_out_gives_what_completions_give(server: Server) -> None:
    # vLLM's /inference/v1/generate: token ids in, token ids out, whole or streamed.
    ids = httpx.post(f"{server.url}/tokenize", json={"model": CHAT, "prompt": PROMPT}).json()
    body = {
        "token_ids": ids["tokens"],
        "sampling_params": {"max_tokens": 6, "temperature": 0, "logprobs": 2},
    }
    whole = httpx.post(f"{server.url}/inference/v1/generate", json=body).json()
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["token_ids"]
    ]
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    assert whole["usage"] == {
        "prompt_tokens": ids["count"],
        "completion_tokens": 6,
        "total_tokens": ids["count"] + 6,
    }
    text = httpx.post(
        f"{server.url}/detokenize", json={"model": CHAT, "tokens": choice["token_ids"]}
    ).json()["prompt"]
    same = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": CHAT, "prompt": ids["tokens"], "max_tokens": 6, "temperature": 0},
    ).json()
    assert text == same["choices"][0]["text"]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/generate", json=streamed) as answer:
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    pieces = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert pieces == choice["token_ids"] and chunks[-1]["usage"] == whole["usage"]
    for field, change in [
        ("sampling_params", {"sampling_params": {"temperature": 3}}),
        ("token_ids", {"token_ids": [10**9]}),
        ("token_ids", {"token_ids": []}),
        ("sampling_params.stop_token_ids", {"sampling_params": {"stop_token_ids": [10**9]}}),
    ]:
        refused = httpx.post(f"{server.url}/inference/v1/generate", json={**body, **change})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


RESPONSES_CHOICES: dict[str, Any] = {
    "model": CHAT,
    "input": "Hi",
    "max_output_tokens": 4,
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    "tool_choice": "none",
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "reasoning": {"effort": "low"},
    "stream": False,
    "stream_options": None,
    "background": False,
    "conversation": None,  # objects OpenAI keeps: refused by name, below
    "prompt": None,
    "previous_response_id": None,
    "temperature": 0,
    "top_p": 1,
    "service_tier": "flex",
    "metadata": {"run": "7"},
    "truncation": "disabled",
    "include": ["message.output_text.logprobs"],
}


def test_responses_accepts_every_parameter_of_the_sdk(client: openai.OpenAI) -> None:
    method = client.responses.create
    body = every_parameter(
        response_create_params.ResponseCreateParamsBase, method, RESPONSES_CHOICES
    )
    response = method(**{k: v for k, v in body.items() if v is not None})
    assert response.status == "incomplete" and response.metadata == {"run": "7"}
    assert response.reasoning.effort == "low" and response.service_tier == "flex"


@pytest.mark.parametrize(
    ("field", "value"),
    [("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"})],
)
def test_responses_refuses_what_openai_keeps_by_name(
    server: Server, field: str, value: Any
) -> None:
    answer = httpx.post(
        f"{server.url}/v1/responses", json={"model": CHAT, "input": "Hi", field: value}
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field


def test_a_background_response_is_read_while_it_runs_and_cancelled(
    client: openai.OpenAI,
) -> None:
    done = client.responses.create(model=CHAT, input="Hi", max_output_tokens=3, background=True)
    assert done.background is True and done.status in ("in_progress", "incomplete")
    wait_for(lambda: client.responses.retrieve(done.id).status == "incomplete")
    assert client.responses.retrieve(done.id).output_text
    long = client.responses.create(
        model=CHAT, input="Tell a long story.", max_output_tokens=900, background=True
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == (
        "cancelled"
    )
    assert client.responses.cancel(done.id).status == "incomplete"  # ended: as it ended


@pytest.mark.parametrize("kind", ["mcp", "web_search_preview", "code_interpreter"])
def test_a_tool_carpool_cannot_run_is_refused_by_its_type(server: Server, kind: str) -> None:
    body = {"model": CHAT, "input": "Hi", "tools": [{"type": kind, "server_label": "x"}]}
    answer = httpx.post(f"{server.url}/v1/responses", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"
    assert kind in answer.json()["error"]["message"]


def test_a_field_no_api_defines_is_ignored_and_logged(server: Server) -> None:
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "x_vendor_hint": 1})
    assert answer.status_code == 200
    wait_for(lambda: any("x_vendor_hint" in line and "WARNING" in line for line in server.log))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "extreme"),
        ("verbosity", 3),
        ("metadata", {"k": 1}),
        ("modalities", ["text", "audio"]),
        ("service_tier", 5),
        ("temperature", 3),
    ],
)
def test_a_wrong_value_is_a_400_naming_the_field(server: Server, field: str, value: Any) -> None:
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Hi"}], field: value}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field


# --- vLLM's command line ------------------------------------------------------------


def test_a_vllm_command_line_serves_one_model_under_each_of_its_names() -> None:
    vllm_line = [CHAT, "--served-model-name", "a", "b", "--enable-auto-tool-choice"]
    vllm_line += ["--tool-call-parser", "hermes", "--max-model-len", "1024", "--dtype", "float"]
    vllm_line += ["--tensor-parallel-size", "1", "--trust-remote-code"]
    s = start_server(*vllm_line, "--kv-cache-memory", "256MiB")
    try:
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0) as c:
            assert {m.id for m in c.models.list()} == {"a", "b"}
            for name in ("a", "b"):
                reply = c.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
                )
                assert reply.model == "a" and reply.choices[0].finish_reason == "length"
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve(CHAT)
    finally:
        assert stop_server(s) == 0
    assert any("runs no code" in line for line in s.log)


# --- LitServe's LitAPI ---------------------------------------------------------------

LIT_API = '''
class Scaler:
    """LitServe's contract, written as a LitServe user writes it."""

    def setup(self, device):
        self.factor = 3.0
        self.batches = []

    def decode_request(self, request):
        return float(request["x"])

    def batch(self, inputs):
        self.batches.append(len(inputs))
        return list(inputs)

    def predict(self, xs):
        if any(x < 0 for x in xs):
            raise ValueError("negative input")
        return [x * self.factor for x in xs]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"y": output, "largest_batch": max(self.batches)}
'''


def test_a_litapi_class_is_served_at_predict_and_batched(tmp_path: Any) -> None:
    folder = tmp_path / "scaler"
    folder.mkdir()
    (folder / "model.py").write_text(LIT_API)
    (folder / "carpool.toml").write_text(
        "max_batch_size = 8\nbatch_timeout = 0.05\n"
        'source = { kind = "litapi", target = "model:Scaler" }\n'
    )
    s = start_server("--model-repository", str(tmp_path))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post("/predict", json={"x": 2}).json()["y"] == 6.0
            assert c.post("/v1/models/scaler/predict", json={"x": 1}).json()["y"] == 3.0
            bad = c.post("/predict", json={"x": -1})
            assert bad.status_code == 500 and "ValueError: negative input" in bad.text
            assert c.post("/predict", content=b"{not json").status_code == 400
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(
                pool.map(
                    lambda x: httpx.post(f"{s.url}/predict", json={"x": x}, timeout=60).json(),
                    range(16),
                )
            )
        assert [a["y"] for a in answers] == [3.0 * x for x in range(16)]
        assert max(a["largest_batch"] for a in answers) > 1  # requests shared a predict
    finally:
        assert stop_server(s) == 0
