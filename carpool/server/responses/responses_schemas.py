"""OpenAI's Responses request (``POST /v1/responses``), validated at the edge.

As ``schemas``: every field of the openai SDK's ``responses.create`` typed, fields no
API defines ignored (logged), the parts strict. ``reasoning.effort`` and
``text.verbosity`` reach the chat template's switches; ``conversation`` and ``prompt``
(objects kept at OpenAI) are refused by name; ``background`` runs it as a task
(``GET`` reads it, ``/cancel`` ends it); the rest are
accepted and change nothing. Content other than text is refused by the adapter,
naming the part.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from carpool.server.generation.schemas import (
    INT64_MAX,
    INT64_MIN,
    FunctionDefinition,
    JsonObjectFormat,
    Metadata,
    OpenAIBody,
    ReasoningEffort,
    Strict,
    TextFormat,
    function_tools_only,
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


class Reasoning(Strict):
    """The ``reasoning`` configuration: its effort reaches the template's switch."""

    effort: ReasoningEffort | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None


# Objects OpenAI keeps and a request names; what to send here instead.
_KEPT_AT_OPENAI = {
    "conversation": "conversations are not kept here; continue with previous_response_id",
    "prompt": "stored prompts are not available; send instructions and input",
}


class ResponsesRequest(OpenAIBody):
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
    metadata: Metadata | None = None
    user: StrictStr | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[StrictStr] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: StrictStr | None = None
    background: StrictBool | None = None
    background_options: dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    stream_options: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    timeout: float | None = Field(default=None, gt=0)

    _tool_types = field_validator("tools", mode="before")(function_tools_only)

    @model_validator(mode="after")
    def _background_is_stored(self) -> Self:
        if self.background and (self.stream or not self.store):
            raise ValueError("a background response is stored and not streamed here")
        return self

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_kept_here(cls, value: object, info: ValidationInfo) -> object:
        if value is not None:
            raise ValueError(_KEPT_AT_OPENAI[str(info.field_name)])
        return value
