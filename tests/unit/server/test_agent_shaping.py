"""The Responses and Messages shapes as pure functions of a reply's events: the
streamed events come in each protocol's order with the fields its SDKs read, and the
whole answer is what the stream ends with."""

from __future__ import annotations

import json
from typing import Any

from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.sequence import FinishReason
from carpool.errors import Overloaded
from carpool.server.anthropic.messages_shaping import MessageShaper
from carpool.server.generation.reply_reader import ArgumentsDelta, CallStarted, TextDelta
from carpool.server.generation.reply_stream import Finished, ReasoningDelta, StreamEvent
from carpool.server.responses.responses_schemas import ResponsesRequest
from carpool.server.responses.responses_shaping import ResponseShaper


def finished(
    reason: FinishReason = FinishReason.STOP, generated: int = 3, stop: str | None = None
) -> Finished:
    out = CompletionOutput(
        0, token_ids=list(range(generated)), finish_reason=reason, stop_reason=stop
    )
    return Finished(RequestOutput("r", [1, 2, 3, 4], [out], finished=True, num_cached_tokens=2))


CALL = [CallStarted(0, "call_1", "add"), ArgumentsDelta(0, '{"a": '), ArgumentsDelta(0, "1}")]


def run(shaper: Any, events: list[StreamEvent]) -> list[tuple[str, dict[str, Any]]]:
    sent = [*shaper.started()]
    for event in events:
        sent += shaper.on(event)
    return [(e["event"], json.loads(e["data"])) for e in sent]


def responses(**fields: Any) -> ResponseShaper:
    return ResponseShaper(
        ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields}), "m", 7
    )


def test_a_text_response_streams_in_the_responses_order() -> None:
    shaper = responses()
    sent = run(shaper, [TextDelta("Hel"), TextDelta("lo"), finished()])
    assert [kind for kind, _ in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in sent] == list(range(len(sent)))
    assert all(data["type"] == kind for kind, data in sent)
    assert (
        sent[0][1]["response"]["status"] == "in_progress" and sent[0][1]["response"]["output"] == []
    )
    assert sent[2][1]["item"]["content"] == []  # as it was when added
    assert sent[6][1]["text"] == "Hello"
    final = sent[-1][1]["response"]
    assert final == shaper.response() and final["status"] == "completed"
    (message,) = final["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert (
        message["content"][0]["type"] == "output_text" and message["content"][0]["text"] == "Hello"
    )
    assert final["usage"] == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 7,
    }


def test_a_function_call_streams_its_arguments_and_ends_whole() -> None:
    shaper = responses()
    sent = run(shaper, [TextDelta("ok"), *CALL, finished()])
    kinds = [kind for kind, _ in sent]
    assert kinds[kinds.index("response.output_text.done") :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = sent[kinds.index("response.output_item.added", 3)][1]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    done = sent[kinds.index("response.function_call_arguments.done")][1]
    assert done["arguments"] == '{"a": 1}' and done["output_index"] == 1
    call = shaper.response()["output"][1]
    assert call == {
        "type": "function_call",
        "id": call["id"],
        "call_id": "call_1",
        "name": "add",
        "arguments": '{"a": 1}',
        "status": "completed",
    }


def test_a_response_cut_by_max_output_tokens_is_incomplete() -> None:
    shaper = responses(max_output_tokens=3)
    sent = run(shaper, [TextDelta("abc"), finished(FinishReason.LENGTH)])
    assert sent[-1][0] == "response.incomplete"
    assert shaper.response()["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_empty_reply_is_an_empty_message_and_a_failure_ends_the_stream() -> None:
    shaper = responses()
    run(shaper, [finished(generated=0)])
    assert [i["type"] for i in shaper.response()["output"]] == ["message"]
    failing = responses()
    events = [(e["event"], json.loads(e["data"])) for e in failing.failed(Overloaded("busy"))]
    assert [k for k, _ in events] == ["error", "response.failed"]
    assert events[1][1]["response"]["error"] == {"code": "overloaded_error", "message": "busy"}


def test_the_response_echoes_the_request() -> None:
    shaper = responses(
        instructions="be brief",
        tool_choice={"type": "function", "name": "add"},
        tools=[{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        metadata={"k": "v"},
    )
    body = shaper.response()
    assert body["instructions"] == "be brief" and body["metadata"] == {"k": "v"}
    assert body["tool_choice"] == {"type": "function", "name": "add"}
    assert body["tools"] == [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    assert body["text"]["format"]["schema"] == {"type": "object"}


def test_a_message_streams_in_the_messages_order() -> None:
    shaper = MessageShaper("m", 4, [])
    sent = run(shaper, [TextDelta("Hi"), TextDelta("!"), *CALL, finished()])
    assert [kind for kind, _ in sent] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = sent[0][1]["message"]
    assert start["content"] == [] and start["usage"] == {"input_tokens": 4, "output_tokens": 0}
    assert sent[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert sent[3][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert sent[6][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "add",
        "input": {},
    }
    assert sent[7][1] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"a": '},
    }
    assert sent[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert sent[10][1]["usage"] == {"output_tokens": 3}
    message = shaper.message()
    assert message["content"] == [
        {"type": "text", "text": "Hi!"},
        {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use" and message["type"] == "message"


def test_message_stop_reasons() -> None:
    def reason(final: Finished, stops: list[str]) -> tuple[Any, Any]:
        shaper = MessageShaper("m", 1, stops)
        run(shaper, [TextDelta("x"), final])
        return shaper.stop_reason, shaper.stop_sequence

    assert reason(finished(), []) == ("end_turn", None)
    assert reason(finished(FinishReason.LENGTH), []) == ("max_tokens", None)
    assert reason(finished(stop="END"), ["END"]) == ("stop_sequence", "END")
    cut = MessageShaper("m", 1, [])
    run(cut, [CallStarted(0, "c", "f"), ArgumentsDelta(0, '{"a": '), finished(FinishReason.LENGTH)])
    assert cut.message()["content"][0]["input"] == {}  # cut short: no arguments that parse
    assert cut.stop_reason == "max_tokens"


def test_a_failed_message_stream_ends_with_anthropics_error() -> None:
    (event,) = MessageShaper("m", 1, []).failed(Overloaded("busy"))
    assert event["event"] == "error"
    assert json.loads(event["data"]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }


def test_reasoning_is_its_own_responses_item_before_the_message() -> None:
    shaper = responses()
    thought = [ReasoningDelta("Think"), ReasoningDelta("ing.")]
    sent = run(shaper, [*thought, TextDelta("Blue"), finished()])
    kinds = [kind for kind, _ in sent]
    assert kinds[2:7] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
    ]
    assert kinds[7] == "response.output_item.added"  # the message, after
    assert sent[5][1]["text"] == "Thinking." and sent[3][1]["delta"] == "Think"
    reasoning, message = shaper.response()["output"]
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "completed"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Blue"
    all_thought = responses()
    run(all_thought, [*thought, finished()])
    kinds_out = [item["type"] for item in all_thought.response()["output"]]
    assert kinds_out == ["reasoning", "message"]  # an answer all thinking has an empty message


def test_reasoning_is_a_thinking_block_before_the_text() -> None:
    shaper = MessageShaper("m", 4, [])
    sent = run(shaper, [ReasoningDelta("Hmm"), ReasoningDelta("."), TextDelta("Hi"), finished()])
    assert sent[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert sent[3][1]["delta"] == {"type": "thinking_delta", "thinking": "Hmm"}
    assert [kind for kind, _ in sent][5:7] == ["content_block_stop", "content_block_start"]
    assert shaper.message()["content"] == [
        {"type": "thinking", "thinking": "Hmm.", "signature": ""},
        {"type": "text", "text": "Hi"},
    ]
