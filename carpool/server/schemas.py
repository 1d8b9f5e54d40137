"""Request bodies, validated at the edge with pydantic.

Strict throughout: no unknown fields, no coercion (``"stream": "yes"`` is not a
boolean), no NaN or Infinity. A string that is not valid Unicode is refused before
validation (``unicode_check``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Strict(BaseModel):
    """A request body's part: unknown fields refused, no NaN or Infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Ranges are checked where the vocabulary is known: a per-element bound here doubled
# the time to validate a long list, all of it on the event loop.
TokenIds = list[StrictInt]


def _prompt_kind(value: Any) -> str:
    """Which form of a prompt ``value`` is, from its first element: validating a long
    list against every member of the union (pydantic's default) costs seconds."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "texts"
        if isinstance(value[0], list):
            return "id_lists"
    return "ids"


# A string, strings, token ids, or lists of token ids (OpenAI's prompt and input).
Prompt = Annotated[
    Annotated[StrictStr, Tag("text")]
    | Annotated[list[StrictStr], Tag("texts")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Tag("id_lists")],
    Discriminator(_prompt_kind),
]


class EmbeddingRequest(Strict):
    """OpenAI's embeddings request, plus carpool's ``priority``, ``timeout`` and
    TEI's ``truncate``."""

    model: StrictStr
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    priority: StrictInt | None = Field(default=None, description="Priority level; 1 runs first.")
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the request may wait in the queue (shortens the default).",
    )
    truncate: StrictBool = Field(
        default=False,
        description="Cut inputs longer than the model's maximum instead of refusing them.",
    )


class V2Tensor(BaseModel):
    """One tensor of an inference-protocol request."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    datatype: StrictStr
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class V2RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr
    parameters: dict[str, Any] | None = None


class V2InferRequest(Strict):
    """The Open Inference Protocol's inference request (JSON part)."""

    id: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[V2Tensor] = Field(min_length=1)
    outputs: list[V2RequestedOutput] | None = None


# Stop strings are checked against the text at every generated token, each against the
# end of the text held back: the cost per token grows with their count and with the
# square of their length, so both are capped (OpenAI takes 4; Anthropic's API, 16 here).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
StopString = Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    # "schema" would shadow pydantic's own attribute; the wire name is kept.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, a list of
    choices, or a Lark grammar."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None


LogitBias = dict[StrictStr, Annotated[float, Field(ge=-100, le=100)]]


class SamplingFields(Strict):
    """The sampling fields shared by chat and completions: OpenAI's, vLLM's extras,
    and carpool's ``priority`` and ``timeout``."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stop: Stop = None
    seed: StrictInt | None = Field(
        default=None, ge=INT64_MIN, le=INT64_MAX, description="A signed 64-bit integer."
    )
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    skip_special_tokens: StrictBool = True
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)
    priority: StrictInt = Field(
        default=0, ge=INT64_MIN, le=INT64_MAX, description="Lower runs first (vLLM's meaning)."
    )
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the request may wait to start (shortens the server's default).",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    logit_bias: LogitBias | None = Field(
        default=None, description="Token id (as a string) to a bias in [-100, 100]."
    )
    store: StrictBool | None = Field(default=None, description="Accepted; nothing is stored.")


class CalledFunction(Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: StrictStr | None = None


class FunctionDefinition(Strict):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: StrictStr


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """OpenAI's chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[StrictStr, Any] | None = Field(
        default=None,
        description="Extra variables for the chat template (vLLM's), e.g. Qwen3's enable_thinking.",
    )


class CompletionRequest(SamplingFields):
    """OpenAI's (legacy) completion request."""

    prompt: Prompt
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    suffix: None = None


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(Strict):
    model: StrictStr
    tokens: TokenIds


# --- task endpoints over repository models (rerank, score, classify, predict) -----------

MAX_TASK_ITEMS = 1024
TaskText = Annotated[StrictStr, Field(min_length=1)]


class RerankDocument(Strict):
    text: TaskText


class RerankRequest(Strict):
    """Cohere's / Jina's / vLLM's rerank request."""

    model: StrictStr
    query: TaskText
    documents: list[TaskText | RerankDocument] = Field(min_length=1, max_length=MAX_TASK_ITEMS)
    top_n: Annotated[StrictInt, Field(ge=1)] | None = None
    return_documents: StrictBool = True
    priority: StrictInt | None = None
    timeout: float | None = Field(default=None, gt=0)


TextOrTexts = TaskText | Annotated[list[TaskText], Field(min_length=1, max_length=MAX_TASK_ITEMS)]


class ScoreRequest(Strict):
    """vLLM's score request: ``text_1`` against each of ``text_2`` (or pairwise)."""

    model: StrictStr
    text_1: TextOrTexts
    text_2: TextOrTexts
    priority: StrictInt | None = None
    timeout: float | None = Field(default=None, gt=0)


class ClassifyRequest(Strict):
    """vLLM's classify request."""

    model: StrictStr
    input: TextOrTexts
    priority: StrictInt | None = None
    timeout: float | None = Field(default=None, gt=0)


class PredictRequest(Strict):
    """TEI's predict request (``model`` is carpool's: which classifier, when several)."""

    inputs: TextOrTexts
    model: StrictStr | None = None
    raw_scores: StrictBool = False
    truncate: StrictBool = False
