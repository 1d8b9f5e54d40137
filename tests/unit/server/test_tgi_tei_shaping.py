"""TGI's and TEI's response shapes as pure functions of what the engine and the
embedders computed."""

from __future__ import annotations

import numpy as np

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason
from carpool.server.tei.tei_shaping import cut_to, normalized, rerank_body, similarities
from carpool.server.tgi.tgi_shaping import (
    StreamShaper,
    TokenFacts,
    error_body,
    finish_reason,
    generate_body,
    token_texts,
)

LETTERS = "abcdefghij"
FACTS = TokenFacts(lambda ids: "".join(LETTERS[i] for i in ids), frozenset({9}))


def test_finish_reasons_are_tgis() -> None:
    assert finish_reason(CompletionOutput(0, finish_reason=FinishReason.LENGTH)) == "length"
    stop = CompletionOutput(0, finish_reason=FinishReason.STOP, stop_reason="\n")
    assert finish_reason(stop) == "stop_sequence"
    assert finish_reason(CompletionOutput(0, finish_reason=FinishReason.STOP)) == "eos_token"


def test_token_texts_join_to_what_the_step_added() -> None:
    assert token_texts(FACTS, [0, 1], "ab") == ["a", "b"]
    # A stop string held back or cut: the pieces no longer join; the text goes last.
    assert token_texts(FACTS, [0, 1], "a") == ["", "a"]
    assert token_texts(FACTS, [], "") == []


def test_generate_details_carry_tokens_prefill_and_top_tokens() -> None:
    out = CompletionOutput(
        0,
        text="ab",
        token_ids=[0, 9],
        logprobs=[TokenLogprobs(-0.5, ((0, -0.5), (1, -1.0))), TokenLogprobs(-0.1, ())],
        finish_reason=FinishReason.LENGTH,
    )
    final = RequestOutput("r", [2, 3], [out], True, prompt_logprobs=[None, TokenLogprobs(-2.0, ())])
    assert generate_body(FACTS, final, prefix="", details=False, seed=None, top_n=False) == {
        "generated_text": "ab"
    }
    body = generate_body(FACTS, final, prefix="cd", details=True, seed=4, top_n=True)
    assert body["generated_text"] == "cdab"
    details = body["details"]
    assert details["tokens"][1] == {"id": 9, "text": "j", "logprob": -0.1, "special": True}
    assert details["prefill"] == [
        {"id": 2, "text": "c", "logprob": None},
        {"id": 3, "text": "d", "logprob": -2.0},
    ]
    assert [t["id"] for t in details["top_tokens"][0]] == [0, 1] and details["seed"] == 4


def test_a_stream_ends_on_its_last_token_with_the_text_and_details() -> None:
    shaper = StreamShaper(FACTS, prefix="", details=True, seed=None, top_n=False)
    first = CompletionOutput(0, text="a", new_text="a", new_token_ids=[0])
    events = shaper.events(RequestOutput("r", [5], [first]))
    assert [e["index"] for e in events] == [1] and events[0]["generated_text"] is None
    last = CompletionOutput(
        0,
        text="abc",
        token_ids=[0, 1, 2],
        new_text="bc",
        new_token_ids=[1, 2],
        finish_reason=FinishReason.LENGTH,
    )
    events = shaper.events(RequestOutput("r", [5], [last], True))
    assert [e["token"]["text"] for e in events] == ["b", "c"]
    assert events[-1]["generated_text"] == "abc" and events[0]["details"] is None
    assert events[-1]["details"] == {
        "finish_reason": "length",
        "generated_tokens": 3,
        "seed": None,
        "input_length": 1,
    }


def test_a_last_output_without_a_token_still_ends_the_stream() -> None:
    shaper = StreamShaper(FACTS, prefix="", details=False, seed=None, top_n=False)
    shaper.events(RequestOutput("r", [5], [CompletionOutput(0, new_token_ids=[3], new_text="")]))
    end = CompletionOutput(0, text="d", new_text="d", finish_reason=FinishReason.STOP)
    (event,) = shaper.events(RequestOutput("r", [5], [end], True))
    assert event["token"]["id"] == 3 and event["token"]["text"] == "d"
    assert event["generated_text"] == "d" and event["details"] is None


def test_error_bodies_name_their_kind() -> None:
    assert error_body(422, "bad") == {"error": "bad", "error_type": "validation"}
    assert error_body(424, "boom")["error_type"] == "generation"
    assert error_body(503, "full")["error_type"] == "overloaded"


def test_tei_vectors_normalize_cut_and_compare() -> None:
    vectors = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [6.0, 8.0, 0.0]])
    unit = normalized(vectors)
    assert np.allclose(unit[0], [0.6, 0.8, 0.0]) and np.allclose(unit[1], 0.0)
    assert cut_to(vectors, 3) is vectors and np.allclose(cut_to(unit, 1), [[1.0], [0.0], [1.0]])
    assert similarities(vectors[[0, 2]]) == [1.0]


def test_tei_rerank_is_best_first_with_text_when_asked() -> None:
    assert rerank_body(["a", "b", "c"], [0.1, 0.9, 0.1], False) == [
        {"index": 1, "score": 0.9},
        {"index": 0, "score": 0.1},
        {"index": 2, "score": 0.1},
    ]
    assert rerank_body(["a"], [0.5], True) == [{"index": 0, "score": 0.5, "text": "a"}]
