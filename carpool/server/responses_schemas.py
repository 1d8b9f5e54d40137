"""OpenAI's Responses request (``POST /v1/responses``), validated at the edge.

Strict as ``schemas``: unknown fields are refused by name. Fields that change nothing
here are accepted and said so (``reasoning``, ``truncation``, ``include``,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``); content other than
text is refused by the adapter, naming the part.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from carpool.server.schemas import (
    INT64_MAX,
    INT64_MIN,
    FunctionDefinition,
    JsonObjectFormat,
    Strict,
    TextFormat,
)


class MessageItem(Strict):
    """A message of the conversation (``type`` may be left out, as the SDK allows)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[dict[str, Any]]
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallItem(Strict):
    """A call the model made earlier (sent back with its output)."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(Strict):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[dict[str, Any]]
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningItem(Strict):
    """The model's earlier reasoning, sent back with the conversation (kept out of the
    next prompt, as chat templates drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else "?"
    return "?"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(FunctionDefinition):
    """A function the model may call (Responses' flat shape: chat's function, typed)."""

    type: Literal["function"]


class NamedFunction(Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    name: StrictStr = Field(min_length=1, max_length=64)
    # "schema" would shadow pydantic's own attribute; the wire name is kept.
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextConfig(Strict):
    format: (
        Annotated[
            TextFormat | JsonObjectFormat | TextFormatJsonSchema,
            Field(discriminator="type"),
        ]
        | None
    ) = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(Strict):
    """OpenAI's Responses request, plus carpool's ``priority`` and ``timeout``."""

    model: StrictStr
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    # OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: (
        dict[
            Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]
        ]
        | None
    ) = Field(default=None, max_length=16)
    user: StrictStr | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[StrictStr] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    background: Literal[False] | None = None
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    timeout: float | None = Field(default=None, gt=0)
