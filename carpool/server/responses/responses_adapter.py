"""A Responses request as a chat request: ``input`` items become chat messages
(``instructions`` the system message, calls and their outputs assistant and tool
turns), ``tools``/``tool_choice``/``text.format`` chat's tools, tool choice and
response format. Pure functions: the route calls them."""

from __future__ import annotations

from typing import Any

from carpool.errors import InvalidRequest
from carpool.server.generation.chat_adapter import as_chat_request
from carpool.server.generation.schemas import ChatCompletionRequest, JsonObjectFormat
from carpool.server.responses.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
    TextFormatJsonSchema,
)

# Chat's field names in errors, as Responses names them.
NAMES = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}

_TEXT_PARTS = ("input_text", "output_text", "text")


def conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``body.input`` as chat messages (plain dicts in chat's shape)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, f"input[{i}]")})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item)
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A content's text: a string, or its text parts joined; other parts are refused."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise InvalidRequest(
                f"only text content is supported (got a part of type {kind!r})",
                param=f"{where}.content[{j}]",
            )
        texts.append(text)
    return "".join(texts)


def _add_call(messages: list[dict[str, Any]], item: FunctionCallItem) -> None:
    """A call joins the assistant turn it follows, or makes one."""
    call = {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that answers ``body``, after ``history`` (the conversation of
    ``previous_response_id``, instructions not carried over, as OpenAI does)."""
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    messages = [*system, *history, *conversation(body)]
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = None
    if body.tools:
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    return as_chat_request(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body),
            "stream": body.stream,
            "user": body.user,
            "reasoning_effort": None if body.reasoning is None else body.reasoning.effort,
            "verbosity": None if body.text is None else body.text.verbosity,
            "priority": body.priority,
            "timeout": body.timeout,
        },
        NAMES,
    )


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    form = None if body.text is None else body.text.format
    if isinstance(form, JsonObjectFormat):
        return {"type": "json_object"}
    if isinstance(form, TextFormatJsonSchema):
        schema = form.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
        return {"type": "json_schema", "json_schema": schema}
    return None


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's ``output`` items as chat messages, for the next turn's history."""
    content = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
