"""OpenAI's response and chunk shapes as pure functions of engine outputs: chat
messages (text or tool calls) and finish reasons, usage, completion logprobs whose
text offsets run on across streamed pieces and an echoed prompt."""

from __future__ import annotations

import json

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sequence import FinishReason
from carpool.server.openai.openai_shaping import Shaper, usage

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
    assert choice["message"] == {
        "role": "assistant",
        "content": "hello",
        "reasoning_content": None,
        "reasoning": None,
    }
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
    assert call["function"] == {"name": "f", "arguments": '{"a":"b"}'}  # as the model wrote it
    answer = tools.full([finished(json.dumps({"response": "hi there"}))])["choices"][0]
    assert answer["message"]["content"] == "hi there" and answer["finish_reason"] == "stop"


def test_a_reply_cut_inside_a_call_keeps_the_whole_calls_and_never_the_wrapper() -> None:
    two = '{"tool_calls":[{"name":"f","arguments":{"a":"x"}},{"name":"f","arguments":{"a":'
    tools = shaper(tool_form="generic")
    (choice,) = tools.full([finished(two, FinishReason.LENGTH)])["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"a":"x"}']
    (early,) = tools.full([finished('{"tool_calls":[{"na', FinishReason.LENGTH)])["choices"]
    assert early["message"]["content"] == "" and "tool_calls" not in early["message"]


def test_a_streamed_tool_call_sends_its_name_then_its_arguments_in_pieces() -> None:
    reply = '{"tool_calls":[{"name":"f","arguments":{"a":"b","c":[1,2]}}]}'
    tools = shaper(tool_form="generic")
    done: set[int] = set()
    request = RequestOutput("r", ids("hi"), [])
    deltas = []
    for at in range(0, len(reply), 4):
        last = at + 4 >= len(reply)
        out = CompletionOutput(
            0, new_text=reply[at : at + 4], finish_reason=FinishReason.STOP if last else None
        )
        choice = tools.delta(0, request, out, done)
        if choice is not None:
            deltas.append(choice)
    entries = [e for d in deltas for e in d["delta"].get("tool_calls", [])]
    first = entries[0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "f"
    pieces = [e["function"]["arguments"] for e in entries if e["function"]["arguments"]]
    assert len(pieces) > 2 and json.loads("".join(pieces)) == {"a": "b", "c": [1, 2]}
    assert [d["finish_reason"] for d in deltas][-1] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    assert all("content" not in d["delta"] for d in deltas)


def test_a_streamed_answer_with_tools_offered_is_decoded_as_it_comes() -> None:
    reply = json.dumps({"response": 'say "hi" \u00e9 \U0001f600'})  # json escapes them
    tools = shaper(tool_form="generic")
    done: set[int] = set()
    request = RequestOutput("r", ids("hi"), [])
    texts = []
    for at in range(len(reply)):
        last = at + 1 == len(reply)
        out = CompletionOutput(
            0, new_text=reply[at], finish_reason=FinishReason.STOP if last else None
        )
        choice = tools.delta(0, request, out, done)
        if choice is not None and "content" in choice["delta"]:
            texts.append(choice["delta"]["content"])
    assert "".join(texts) == json.loads(reply)["response"] and len(texts) > 5


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


def test_a_streamed_call_cut_by_max_tokens_ends_with_length() -> None:
    tools = shaper(tool_form="generic")
    cut = '{"tool_calls":[{"name":"f","arguments":{"a":'
    out = CompletionOutput(0, new_text=cut, finish_reason=FinishReason.LENGTH)
    choice = tools.delta(0, RequestOutput("r", ids("hi"), [out]), out, set())
    assert choice is not None and choice["finish_reason"] == "length"
    assert choice["delta"]["tool_calls"][0]["function"]["name"] == "f"


def test_with_tools_and_a_reasoning_parser_the_thinking_is_split_off_first() -> None:
    # As Messages and Responses read such a reply: thinking, then the answer's calls.
    call = '{"tool_calls":[{"name":"f","arguments":{"a":"b"}}]}'
    reply = f"<think>look it up</think>\n{call}"
    tools = shaper(tool_form="generic", reasoning="qwen3")

    def whole(text: str) -> RequestOutput:  # text beyond the decoder's letters: no ids
        out = CompletionOutput(0, text=text, finish_reason=FinishReason.STOP)
        return RequestOutput("r", ids("hi"), [out], finished=True)

    (choice,) = tools.full([whole(reply)])["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "look it up"
    assert choice["message"]["reasoning"] == "look it up"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "f"
    done: set[int] = set()
    request = RequestOutput("r", ids("hi"), [])
    thinking, arguments, reasons = [], [], []
    for at in range(0, len(reply), 3):
        last = at + 3 >= len(reply)
        out = CompletionOutput(
            0, new_text=reply[at : at + 3], finish_reason=FinishReason.STOP if last else None
        )
        delta = tools.delta(0, request, out, done)
        if delta is None:
            continue
        thinking.append(delta["delta"]["reasoning_content"] or "")
        arguments += [e["function"]["arguments"] for e in delta["delta"].get("tool_calls", [])]
        reasons.append(delta["finish_reason"])
        assert "content" not in delta["delta"] or not delta["delta"]["content"]
    assert "".join(thinking) == "look it up" and json.loads("".join(arguments)) == {"a": "b"}
    assert reasons[-1] == "tool_calls"
    plain = shaper(tool_form="generic", reasoning="qwen3")
    (answer,) = plain.full([whole('<think>no</think>{"response":"hi"}')])["choices"]
    assert answer["message"]["content"] == "hi" and answer["message"]["reasoning_content"] == "no"


def test_a_streamed_tool_reply_carries_its_logprobs_as_plain_text_does() -> None:
    # One folding for every chat choice: the log-probabilities asked for come with the
    # tool-call deltas too, and a piece that completes nothing sends nothing.
    reply = '{"tool_calls":[{"name":"f","arguments":{"a":"b"}}]}'
    for tool_form in ("generic", None):
        chat = shaper(tool_form=tool_form)
        request = RequestOutput("r", ids("hi"), [])
        lp = TokenLogprobs(-0.5, [(0, -0.5)])
        out = CompletionOutput(0, new_text=reply[:20], new_token_ids=[0], new_logprobs=[lp])
        choice = chat.delta(0, request, out, set())
        assert choice is not None
        assert choice["logprobs"]["content"][0]["logprob"] == -0.5
    quiet = shaper(tool_form="generic", reasoning="qwen3")
    assert quiet.delta(0, request, CompletionOutput(0, new_text="<thi"), set()) is None
