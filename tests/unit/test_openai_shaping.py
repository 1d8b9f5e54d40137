"""OpenAI's response and chunk shapes as pure functions of engine outputs: chat
messages (text or tool calls) and finish reasons, usage, completion logprobs whose
text offsets run on across streamed pieces and an echoed prompt."""

from __future__ import annotations

import json

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason
from carpool.server.openai_shaping import Shaper, usage

LETTERS = 'abcdefghijklmnopqrstuvwxyz {}":,_[]'


def decode(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids)


def ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def shaper(**kw: object) -> Shaper:
    args: dict[str, object] = {
        "call_id": "x-1",
        "created": 7,
        "model": "m",
        "n": 1,
        "decode": decode,
        "chat": True,
    }
    return Shaper(**{**args, **kw})  # type: ignore[arg-type]


def finished(
    text: str, reason: FinishReason = FinishReason.STOP, prompt: str = "hi"
) -> RequestOutput:
    out = CompletionOutput(0, text=text, token_ids=ids(text), finish_reason=reason)
    return RequestOutput("r", ids(prompt), [out], finished=True)


def test_a_chat_response_has_the_message_the_reason_and_the_usage() -> None:
    body = shaper().full([finished("hello", FinishReason.LENGTH)])
    assert body["object"] == "chat.completion" and body["id"] == "x-1" and body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hello"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_with_tools_a_reply_becomes_tool_calls_whole_and_streamed() -> None:
    reply = json.dumps(
        {"tool_calls": [{"name": "f", "arguments": {"a": "b"}}]}, separators=(",", ":")
    )
    tools = shaper(tool_form="generic")
    (choice,) = tools.full([finished(reply)])["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": "b"}'}
    out = finished(reply).outputs[0]
    streamed = tools.delta(0, finished(reply), out, set())
    assert streamed is not None and streamed["finish_reason"] == "tool_calls"
    assert streamed["delta"]["tool_calls"][0]["index"] == 0
    answer = tools.full([finished(json.dumps({"response": "hi there"}))])["choices"][0]
    assert answer["message"]["content"] == "hi there" and answer["finish_reason"] == "stop"


def test_streamed_completion_offsets_run_on_after_the_echoed_prompt() -> None:
    shape = shaper(chat=False, echo=True)
    request = RequestOutput("r", ids("ab"), [], prompt_logprobs=None)
    done: set[int] = set()
    texts, offsets = [], []
    for piece in ["cd", "ef"]:
        out = CompletionOutput(
            0,
            new_text=piece,
            new_token_ids=ids(piece),
            new_logprobs=[TokenLogprobs(-0.5, [(i, -0.5)]) for i in ids(piece)],
        )
        choice = shape.delta(0, request, out, done)
        assert choice is not None
        texts.append(choice["text"])
        offsets.append(choice["logprobs"]["text_offset"])
    assert texts == ["abcd", "ef"]  # the prompt first, once
    assert offsets == [[2, 3], [4, 5]]


def test_usage_sums_every_prompt() -> None:
    assert usage([finished("abc"), finished("d", prompt="xyz")]) == {
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "total_tokens": 9,
    }
