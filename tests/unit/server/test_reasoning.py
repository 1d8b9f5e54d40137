"""A reasoning model's reply split into ``reasoning_content`` and ``content``,
whatever the pieces it arrives in, for both parsers; chat_template_kwargs reach the
template, except the template call's own arguments."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.sequence import FinishReason
from carpool.errors import InvalidRequest
from carpool.server.generation.generation_inputs import render_chat
from carpool.server.generation.reasoning import ReasoningSplitter
from carpool.server.generation.schemas import ChatMessage
from carpool.server.openai.openai_shaping import Shaper

CASES = [
    # (parser, reply, reasoning, content)
    ("qwen3", "<think>\nplan it\n</think>\n\nThe answer.", "\nplan it\n", "The answer."),
    ("qwen3", "The answer, no thinking.", "", "The answer, no thinking."),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("deepseek_r1", "plan it</think>\n\nThe answer.", "plan it", "The answer."),
    ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "never closed", "never closed", ""),
    ("deepseek_r1", "</think>", "", ""),
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "a < b </think", "", "a < b </think"),
]


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 100), max_size=6))
@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), CASES)
def test_a_reply_splits_the_same_in_any_pieces(
    parser: str, reply: str, reasoning: str, content: str, cuts: list[int]
) -> None:
    points = sorted({c % (len(reply) + 1) for c in cuts})
    edges = [0, *points, len(reply)]
    splitter = ReasoningSplitter(parser)
    got_reasoning, got_content = "", ""
    for a, b in itertools.pairwise(edges):
        split = splitter.feed(reply[a:b])
        got_reasoning += split.reasoning
        got_content += split.content
    last = splitter.finish()
    got_reasoning += last.reasoning
    got_content += last.content
    assert (got_reasoning, got_content) == (reasoning, content)
    assert (splitter.reasoning, splitter.content) == (reasoning, content)


def shaper(reasoning: str | None) -> Shaper:
    return Shaper(
        call_id="c",
        created=1,
        model="m",
        n=1,
        decode=lambda ids: "",
        chat=True,
        reasoning=reasoning,
    )


def test_chat_messages_carry_reasoning_content_whole_and_streamed() -> None:
    reply = "<think>why</think>\n\nbecause"
    final = RequestOutput(
        "r", [1], [CompletionOutput(0, text=reply, finish_reason=FinishReason.STOP)], True
    )
    (choice,) = shaper("qwen3").full([final])["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "because",
        "reasoning_content": "why",
        "reasoning": "why",
    }
    streaming, done = shaper("qwen3"), set[int]()
    deltas: list[dict[str, Any]] = []
    for k, char in enumerate(reply):
        last = k == len(reply) - 1
        out = CompletionOutput(0, new_text=char, finish_reason=FinishReason.STOP if last else None)
        chunk = streaming.delta(0, RequestOutput("r", [1], [out]), out, done)
        if chunk is not None:
            deltas.append(chunk["delta"])
    assert "".join(d["reasoning_content"] or "" for d in deltas) == "why"
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas)  # vLLM's newer name
    assert "".join(d.get("content", "") for d in deltas) == "because"
    first_content = next(i for i, d in enumerate(deltas) if "content" in d)
    assert all(d["reasoning_content"] is None for d in deltas[first_content:])


TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(smollm_folder: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm_folder))
    tokenizer.chat_template = TEMPLATE
    served: Any = SimpleNamespace(tokenizer=tokenizer)
    hello = [ChatMessage(role="user", content="hi")]
    assert render_chat(served, hello, True) == "hi"
    off = render_chat(served, hello, True, template_kwargs={"enable_thinking": False})
    assert off == "hi<think>\n\n</think>\n\n"
    with pytest.raises(InvalidRequest) as caught:
        render_chat(served, hello, True, template_kwargs={"tokenize": True})
    assert caught.value.param == "chat_template_kwargs"
