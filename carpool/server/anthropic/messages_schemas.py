"""Anthropic's Messages request (``POST /v1/messages``, ``/v1/messages/count_tokens``),
validated at the edge.

Strict as ``schemas``: unknown fields are refused by name. ``temperature``, ``top_p``
and ``top_k`` are taken as older SDKs send them. Accepted and changing nothing here:
``cache_control`` (on the request, blocks and tools), ``metadata``, ``service_tier``,
``speed``, ``inference_geo``, ``output_config.effort``, ``thinking`` (no thinking
blocks are produced; thinking blocks sent back in the history are dropped), citations
on text. Blocks other than text, tool_use, tool_result and
thinking (images, documents) are refused, naming the block.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from carpool.server.generation.schemas import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP_STRINGS,
    StopString,
    Strict,
)

CacheControl = dict[str, Any] | None


class TextBlock(Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: StrictStr


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class AnthropicTool(Strict):
    """A client tool: its name, description and the JSON schema of its input."""

    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoiceAuto(Strict):
    type: Literal["auto", "any", "none"]
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool | None = None


AnthropicToolChoice = Annotated[ToolChoiceAuto | ToolChoiceTool, Field(discriminator="type")]


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    # "schema" would shadow pydantic's own attribute; the wire name is kept.
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    """Structured output (``format``); ``effort`` is accepted and changes nothing."""

    format: JsonOutputFormat | None = None
    effort: StrictStr | None = None


class CountTokensRequest(Strict):
    """What ``/v1/messages/count_tokens`` counts: the prompt a Messages request makes."""

    model: StrictStr
    messages: list[InputMessage] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """Anthropic's Messages request, plus carpool's ``priority`` and ``timeout``."""

    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[StopString] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stream: StrictBool = False
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    cache_control: CacheControl = None
    speed: StrictStr | None = None
    inference_geo: StrictStr | None = None
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    timeout: float | None = Field(default=None, gt=0)
