"""Tool calling through a generic JSON wrapper (llama.cpp's "generic" format), for
any chat template: the tools are described in a system message, and the model's
reply is constrained by a grammar to one JSON object, either

    {"tool_calls": [{"name": "<tool>", "arguments": {...}}, ...]}   (calling tools)
    {"response": "<text>"}                                         (answering)

``required`` allows only the first form, a named function only its own calls,
``auto`` both, ``parallel_tool_calls: false`` one call at most. Each call's
``arguments`` must match its tool's ``parameters`` schema. Assistant turns that
called tools are rendered back in the same wrapper, so the model sees its own
format in the history. Pure functions over plain data: the routes call them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from carpool.engine.sampling_params import Grammar
from carpool.errors import InvalidRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None


def chosen_tools(
    tools: list[ToolSpec], choice: str | None, named: str | None
) -> tuple[list[ToolSpec], bool]:
    """The tools the model may call and whether it must call one, for OpenAI's
    ``tool_choice`` (``choice``: none, auto or required; ``named``: a function's
    name). No tools at all for ``none``. Raises InvalidRequest naming the field."""
    if named is not None:
        picked = [t for t in tools if t.name == named]
        if not picked:
            raise InvalidRequest(
                f"tool_choice names {named!r}, which is not in tools", param="tool_choice"
            )
        return picked, True
    if choice == "none":
        return [], False
    return tools, choice == "required"


def tool_grammar(tools: list[ToolSpec], required: bool, parallel: bool) -> Grammar:
    """The grammar of a reply to a request offering ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": t.parameters or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    calling = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    answering = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    schema = calling if required else {"anyOf": [calling, answering]}
    return Grammar("json_schema", json.dumps(schema))


def tools_prompt(tools: list[ToolSpec], required: bool) -> str:
    """The system text that offers ``tools`` and states the reply format."""
    described = [
        {"name": t.name, "description": t.description or "", "parameters": t.parameters or {}}
        for t in tools
    ]
    calling = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
    lines = [
        "You can call these tools:",
        json.dumps(described, ensure_ascii=False),
        f"To call tools, reply with one JSON object: {calling}",
    ]
    if not required:
        lines.append('To answer without a tool, reply with: {"response": "<your answer>"}')
    return "\n".join(lines)


def with_tools_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """``messages`` with ``prompt`` added to the system message (one is made first)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def calls_as_content(tool_calls: list[dict[str, Any]], param: str) -> str:
    """An assistant turn's OpenAI ``tool_calls`` as the wrapper's JSON text. Raises
    InvalidRequest naming ``param`` when a call's arguments are not a JSON object."""
    calls = []
    for i, call in enumerate(tool_calls):
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(
                f"{param}[{i}].function.arguments must be a JSON object", param=param
            )
        calls.append({"name": function["name"], "arguments": arguments})
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


@dataclass(frozen=True)
class Reply:
    """A generated reply read back: the answer's text, or the calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None


def read_reply(text: str) -> Reply:
    """The reply in ``text`` (the wrapper's JSON); text that is not a whole wrapper
    (cut by ``max_tokens``) is returned as content, as it is."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return Reply(text, None)
    if isinstance(data, dict) and isinstance(data.get("tool_calls"), list):
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(call["arguments"], ensure_ascii=False),
                },
            }
            for call in data["tool_calls"]
        ]
        return Reply(None, calls)
    if isinstance(data, dict) and isinstance(data.get("response"), str):
        return Reply(data["response"], None)
    return Reply(text, None)
