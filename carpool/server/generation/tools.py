"""Tool calling in the model's own syntax where its chat template has one, else
through a generic JSON wrapper.

A template that takes ``tools`` and writes calls in ``<tool_call>`` tags (Hermes,
Qwen2.5 and their kin: ``hermes``) gets the tools and the history's calls in its own
syntax, and its replies are read in that syntax: with ``required`` or a named
function a grammar allows only ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks; with ``auto`` the model is free and the blocks it writes are read back (as
vLLM's hermes parser does).

Any other template (``generic``, llama.cpp's generic format) gets the tools
described in a system message, and the model's reply is constrained by a grammar to
one JSON object, either

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
import re
from dataclasses import dataclass
from typing import Any

from carpool.engine.sampling_params import Grammar
from carpool.engine.structured import closed_objects
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


GENERIC, HERMES = "generic", "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def template_format(chat_template: str | None) -> str:
    """``hermes`` when the template takes tools and writes calls in ``<tool_call>``
    tags, else ``generic``."""
    if chat_template and "tools" in chat_template and OPEN in chat_template:
        return HERMES
    return GENERIC


def _call_schemas(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.name},
                "arguments": closed_objects(t.parameters) if t.parameters else ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]


def tool_grammar(
    tools: list[ToolSpec], required: bool, parallel: bool, form: str = GENERIC
) -> Grammar | None:
    """The grammar of a reply to a request offering ``tools`` in ``form`` (None:
    the reply is free, ``auto`` in the model's own syntax)."""
    calls = _call_schemas(tools)
    if form == HERMES:
        if not required:
            return None
        body = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
        lark = (
            f"start: call{'+' if parallel else ''}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(body)}"
        )
        return Grammar("lark", lark)
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


def hermes_history(tool_calls: list[dict[str, Any]], param: str) -> list[dict[str, Any]]:
    """An assistant turn's OpenAI ``tool_calls`` as chat templates take them
    (arguments as objects). Raises InvalidRequest naming ``param`` when a call's
    arguments are not a JSON object."""
    calls = json.loads(calls_as_content(tool_calls, param))["tool_calls"]
    return [{"type": "function", "function": c} for c in calls]
