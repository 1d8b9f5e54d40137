"""The Responses and Messages requests as chat requests (one path to the engine),
errors in each protocol's names and shape, and the bounded store of responses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from carpool.errors import InvalidRequest, ModelNotFound, RequestTooLarge
from carpool.server.anthropic import messages_adapter
from carpool.server.anthropic.messages_schemas import CountTokensRequest, MessagesRequest
from carpool.server.generation.chat_adapter import protocol_names
from carpool.server.http.errors import error_body
from carpool.server.responses import responses_adapter
from carpool.server.responses.response_store import ResponseNotFound, ResponseStore, StoredResponse
from carpool.server.responses.responses_schemas import ResponsesRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def responses_chat(history: list[dict[str, Any]] | None = None, **fields: Any) -> Any:
    body = ResponsesRequest.model_validate({"model": "m", **fields})
    return responses_adapter.chat_request(body, history or [])


def messages(**fields: Any) -> list[dict[str, Any]]:
    chat = messages_adapter.chat_request(
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **fields})
    )
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def test_responses_input_items_become_a_chat_conversation() -> None:
    chat = responses_chat(
        history=[{"role": "user", "content": "before"}],
        instructions="be brief",
        input=[
            {"role": "user", "content": "add 1 and 2"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "ok"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "and "},
                    {"type": "input_text", "text": "so?"},
                ],
            },
        ],
        max_output_tokens=9,
        tools=[{"type": "function", "name": "add", "parameters": SCHEMA, "strict": True}],
        tool_choice={"type": "function", "name": "add"},
        text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}},
    )
    turns = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert [t["role"] for t in turns] == ["system", "user", "user", "assistant", "tool", "user"]
    assert turns[0]["content"] == "be brief" and turns[1]["content"] == "before"
    assert turns[3]["content"] == "ok" and [c["id"] for c in turns[3]["tool_calls"]] == ["c1", "c2"]
    assert turns[4] == {"role": "tool", "content": "3", "tool_call_id": "c1"}
    assert turns[5]["content"] == "and so?"
    assert chat.max_tokens == 9
    assert chat.tools is not None and chat.tools[0].function.parameters == SCHEMA
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "add"  # type: ignore[union-attr]
    assert chat.response_format is not None
    assert chat.response_format.json_schema.schema_ == SCHEMA  # type: ignore[union-attr]


def test_responses_refuse_what_is_not_text_naming_the_part() -> None:
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    with pytest.raises(InvalidRequest) as caught:
        responses_chat(input=[{"role": "user", "content": "hi"}, image])
    assert caught.value.param == "input[1].content[0]"


def test_chat_errors_are_renamed_to_the_protocols_fields() -> None:
    with pytest.raises(InvalidRequest) as caught, protocol_names(responses_adapter.NAMES):
        raise InvalidRequest("bad schema", param="response_format")
    assert caught.value.param == "text.format"
    with pytest.raises(RequestTooLarge) as too_large, protocol_names(responses_adapter.NAMES):
        raise RequestTooLarge("long", param="messages[3].tool_calls")
    assert too_large.value.param == "input"
    with pytest.raises(InvalidRequest) as stop, protocol_names(messages_adapter.NAMES):
        raise InvalidRequest("x", param="stop")
    assert stop.value.param == "stop_sequences"


def test_an_assistant_turn_carries_its_calls_into_the_next_request() -> None:
    output = [
        {"type": "message", "content": [{"type": "output_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    (turn,) = responses_adapter.assistant_turn(output)
    assert turn["content"] == "hm" and turn["tool_calls"][0]["id"] == "c1"


def test_messages_blocks_become_a_chat_conversation() -> None:
    turns = messages(
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "add"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "3"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "content": [{"type": "text", "text": "no"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "thanks"},
                ],
            },
        ],
    )
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert turns[0]["content"] == "sys"
    call = turns[2]["tool_calls"][0]
    assert turns[2]["content"] == "calling" and call["id"] == "t1"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}
    assert turns[3] == {"role": "tool", "content": "3", "tool_call_id": "t1"}
    assert turns[4]["content"] == "Error: no" and turns[5]["content"] == "thanks"


def test_messages_tools_and_choices_map_to_chats() -> None:
    def chat(choice: dict[str, Any]) -> Any:
        return messages_adapter.chat_request(
            CountTokensRequest.model_validate(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"name": "add", "input_schema": SCHEMA}],
                    "tool_choice": choice,
                }
            )
        )

    assert chat({"type": "any"}).tool_choice == "required"
    assert chat({"type": "none"}).tool_choice == "none"
    named = chat({"type": "tool", "name": "add", "disable_parallel_tool_use": True})
    assert named.tool_choice.function.name == "add" and named.parallel_tool_calls is False
    assert chat({"type": "auto"}).tools[0].function.parameters == SCHEMA


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "messages[0].content[0]"),
    ],
)
def test_misplaced_blocks_are_refused_naming_the_block(content: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        messages(messages=[{"role": "user", "content": content}])
    assert caught.value.param == param
    with pytest.raises(InvalidRequest) as result:
        messages(
            messages=[
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        )
    assert result.value.param == "messages[1].content[0]"


def test_error_bodies_take_the_shape_of_the_path() -> None:
    assert error_body(400, "bad", param="x", path="/v2/models/m/infer") == {"error": "bad"}
    assert error_body(400, "bad", param="x", path="/v1/responses") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": 400}
    }
    assert error_body(400, "bad", param="max_tokens", path="/v1/messages") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: bad"},
    }
    kinds = {
        s: error_body(s, "m", path="/v1/messages/count_tokens")["error"]["type"]  # type: ignore[index]
        for s in (401, 404, 413, 500, 503, 504)
    }
    assert kinds == {
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        500: "api_error",
        503: "overloaded_error",
        504: "api_error",
    }


def test_the_store_keeps_the_most_recent_responses() -> None:
    store = ResponseStore(capacity=2)
    for n in range(3):
        store.keep(StoredResponse({"id": f"r{n}"}, [{"role": "user", "content": str(n)}]))
    with pytest.raises(InvalidRequest) as gone:
        store.history("r0")
    assert gone.value.param == "previous_response_id"
    assert store.history("r2") == [{"role": "user", "content": "2"}]
    assert store.history(None) == []
    store.delete("r1")
    with pytest.raises(ResponseNotFound):
        store.get("r1")
    assert isinstance(ResponseNotFound("x"), ModelNotFound)  # answered 404


def test_the_store_is_bounded_in_bytes_too() -> None:
    def stored(n: int, text: str) -> StoredResponse:
        return StoredResponse({"id": f"r{n}"}, [{"role": "user", "content": text}])

    one = stored(0, "x" * 100).size()
    store = ResponseStore(capacity=100, capacity_bytes=3 * one)
    for n in range(5):
        store.keep(stored(n, "x" * 100))
    assert store.held_bytes == 3 * one
    with pytest.raises(ResponseNotFound):
        store.get("r1")
    assert store.get("r4").conversation[0]["content"] == "x" * 100
    store.keep(stored(9, "y" * 10 * one))  # alone over the bound: not kept, nothing pushed out
    with pytest.raises(ResponseNotFound):
        store.get("r9")
    assert store.held_bytes == 3 * one
    store.delete("r4")
    assert store.held_bytes == 2 * one
