"""A Messages request as a chat request: ``system`` the system message, text blocks
the turns' text, ``tool_use`` blocks an assistant turn's calls, ``tool_result`` blocks
tool turns; ``tools``' ``input_schema`` chat's ``parameters``; ``tool_choice``
``auto``/``any``/``tool``/``none`` chat's ``auto``/``required``/named/``none``;
``output_config.format`` chat's JSON-schema ``response_format``. Pure
functions: the route calls them."""

from __future__ import annotations

import json
from typing import Any

from carpool.errors import InvalidRequest
from carpool.server.anthropic.messages_schemas import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from carpool.server.generation.chat_adapter import as_chat_request
from carpool.server.generation.schemas import ChatCompletionRequest

# Chat's field names in errors, as Messages names them.
NAMES = {
    "prompt": "messages",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
}


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def conversation(body: CountTokensRequest) -> list[dict[str, Any]]:
    """``body``'s system text and messages as chat messages (plain dicts)."""
    messages: list[dict[str, Any]] = []
    system = body.system if isinstance(body.system, str) else _joined(body.system or [])
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts = [b for b in message.content if isinstance(b, TextBlock)]
        uses = [(j, b) for j, b in enumerate(message.content) if isinstance(b, ToolUseBlock)]
        results = [(j, b) for j, b in enumerate(message.content) if isinstance(b, ToolResultBlock)]
        if message.role == "user":
            if uses:
                raise InvalidRequest(
                    "tool_use blocks belong in assistant messages",
                    param=f"messages[{i}].content[{uses[0][0]}]",
                )
            messages += [_tool_turn(b) for _, b in results]
            if texts:
                messages.append({"role": "user", "content": _joined(texts)})
            continue
        if results:
            raise InvalidRequest(
                "tool_result blocks belong in user messages",
                param=f"messages[{i}].content[{results[0][0]}]",
            )
        turn: dict[str, Any] = {"role": "assistant", "content": _joined(texts) or None}
        if uses:
            turn["tool_calls"] = [_call(b) for _, b in uses]
        messages.append(turn)
    return messages


def _tool_turn(block: ToolResultBlock) -> dict[str, Any]:
    content = block.content if isinstance(block.content, str) else _joined(block.content or [])
    if block.is_error:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _call(block: ToolUseBlock) -> dict[str, Any]:
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
    }


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that answers ``body`` (a count-tokens request renders the
    same prompt a Messages request with its fields would)."""
    tools = None
    if body.tools:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice: Any = None
    parallel = True
    if body.tool_choice is not None:
        parallel = not body.tool_choice.disable_parallel_tool_use
        if isinstance(body.tool_choice, ToolChoiceTool):
            choice = {"type": "function", "function": {"name": body.tool_choice.name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[body.tool_choice.type]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": conversation(body),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_sequences,
            "response_format": _response_format(body),
            "stream": body.stream,
            "priority": body.priority,
            "timeout": body.timeout,
        }
    return as_chat_request(fields, NAMES)


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """``output_config.format`` as chat's ``response_format``."""
    form = None if body.output_config is None else body.output_config.format
    if form is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": form.schema_}}
