"""Request bodies, validated at the edge with pydantic.

No coercion (``"stream": "yes"`` is not a boolean), no NaN or Infinity, and every
field of OpenAI's request types typed and ranged. A top-level OpenAI body ignores
fields no API defines, with a logged warning (vLLM's behaviour: a client's extension
must not fail its request); the parts inside it refuse unknown fields. A string that
is not valid Unicode is refused before validation (``unicode_check``).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
    model_validator,
)

log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class Strict(BaseModel):
    """A request body's part: unknown fields refused, no NaN or Infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Field names already warned about: a client that sends an extension sends it with
# every request, and one line per request would drown the log.
_WARNED: set[str] = set()
_MAX_WARNED = 256


def note_ignored(kind: str, names: list[str]) -> None:
    """Log the fields of a ``kind`` body that no API defines (a warning the first
    time a name is seen, debug after)."""
    new = [n for n in names if n not in _WARNED]
    if new and len(_WARNED) < _MAX_WARNED:
        _WARNED.update(new)
        log.warning("%s: ignored fields that no API defines: %s", kind, ", ".join(new[:20]))
    else:
        log.debug("%s: ignored fields: %s", kind, ", ".join(names[:20]))


class OpenAIBody(BaseModel):
    """A top-level OpenAI request body: fields no API defines are ignored (logged)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _note_ignored(self) -> Self:
        if self.model_extra:
            note_ignored(type(self).__name__, sorted(self.model_extra))
        return self


# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of 512.
Metadata = Annotated[
    dict[Annotated[StrictStr, Field(max_length=64)], Annotated[StrictStr, Field(max_length=512)]],
    Field(max_length=16),
]
# The reasoning efforts OpenAI's API takes (reasoning models' template switches).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]


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


class EmbeddingRequest(OpenAIBody):
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


class PoolingRequest(OpenAIBody):
    """vLLM's pooling request over an embedder: ``input`` as the embeddings take it
    (``messages``, for a pooling model with a chat template, is refused by name)."""

    model: StrictStr
    input: Prompt | None = None
    messages: list[dict[StrictStr, Any]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    priority: StrictInt | None = None
    timeout: float | None = Field(default=None, gt=0)
    truncate: StrictBool = False


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


class TagStructure(Strict):
    """One structure of a ``structural_tag``: ``begin``, a JSON value of ``schema``,
    then ``end``."""

    begin: StrictStr = Field(min_length=1, max_length=256)
    schema_: dict[str, Any] = Field(alias="schema")
    end: StrictStr = Field(max_length=256)


class StructuralTagFormat(Strict):
    """vLLM's (xgrammar's) ``structural_tag`` response format: free text, except that
    where a trigger is written, a structure whose ``begin`` starts with that trigger
    must follow."""

    type: Literal["structural_tag"]
    structures: list[TagStructure] = Field(min_length=1, max_length=128)
    triggers: list[Annotated[StrictStr, Field(min_length=1, max_length=256)]] = Field(
        min_length=1, max_length=128
    )


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat | StructuralTagFormat,
    Field(discriminator="type"),
]


MAX_CHOICES = 1024


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, a list of
    choices, or a Lark grammar."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    # More alternatives than this overflowed the grammar engine's limits (a 500).
    choice: list[StrictStr] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: StrictStr | None = None


LogitBias = dict[StrictStr, Annotated[float, Field(ge=-100, le=100)]]


# vLLM's guided_* fields, by the structured_outputs key each stands for.
GUIDED_FIELDS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}


class SamplingFields(OpenAIBody):
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
    service_tier: StrictStr | None = Field(default=None, description="Echoed in the response.")
    # vLLM's older spelling of structured_outputs, still in its users' clients.
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES
    )
    guided_grammar: StrictStr | None = None
    guided_decoding_backend: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    @model_validator(mode="after")
    def _guided_as_structured_outputs(self) -> Self:
        """vLLM's ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``
        as the one ``structured_outputs`` they name (the backend is carpool's)."""
        guided = {kind: getattr(self, field) for kind, field in GUIDED_FIELDS.items()}
        given = {k: v for k, v in guided.items() if v is not None}
        if not given:
            return self
        if self.structured_outputs is not None or len(given) > 1:
            raise ValueError(
                "give one of guided_json, guided_regex, guided_choice and guided_grammar, "
                "and not with structured_outputs"
            )
        self.structured_outputs = StructuredOutputs.model_validate(given)
        return self


class CalledFunction(Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    """A message of the conversation. An assistant's earlier thinking
    (``reasoning_content``, or vLLM's newer ``reasoning``) reaches the chat template
    as ``reasoning_content``; ``audio`` and ``function_call`` are accepted and
    unused."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None


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


def function_tools_only(tools: Any) -> Any:
    """Refuse, by type, tools carpool cannot run (``mcp``, ``web_search_preview``,
    ``code_interpreter``, ...): it runs function tools only."""
    if isinstance(tools, list):
        kinds = sorted(
            {
                kind
                for t in tools
                if isinstance(t, dict) and isinstance(kind := t.get("type"), str)
                if kind != "function"
            }
        )
        if kinds:
            raise ValueError(
                f"tools of type {', '.join(kinds)} cannot run here; carpool runs function "
                "tools only"
            )
    return tools


class ChatCompletionRequest(SamplingFields):
    """OpenAI's chat completion request: every field of the openai SDK's
    ``chat.completions.create`` (``reasoning_effort`` and ``verbosity`` reach the
    chat template's own switches; ``functions``/``function_call`` are read as the
    tools they were replaced by; the rest are accepted and change nothing), plus
    vLLM's extensions."""

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
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    metadata: Metadata | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: StrictStr | None = None
    functions: list[FunctionDefinition] | None = Field(default=None, max_length=128)
    function_call: Literal["none", "auto"] | FunctionName | None = None

    _tool_types = field_validator("tools", mode="before")(function_tools_only)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and "audio" in value:
            raise ValueError("carpool generates text only: audio output is not available")
        return value

    @model_validator(mode="after")
    def _functions_as_tools(self) -> Self:
        """The deprecated ``functions`` and ``function_call`` as ``tools`` and
        ``tool_choice`` (the reply's calls come back as ``tool_calls``)."""
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("give tools and tool_choice, or functions and function_call, not both")
        if self.functions:
            self.tools = [Tool(type="function", function=f) for f in self.functions]
        call = self.function_call
        if isinstance(call, FunctionName):
            self.tool_choice = NamedToolChoice(type="function", function=call)
        elif call is not None and self.tools:
            self.tool_choice = call
        return self


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's ``/v1/chat/completions/batch``: a chat request whose ``messages`` is a
    list of conversations, answered as one completion with a choice per conversation
    (conversation ``i``'s choices at ``i * n ...``). Neither streamed nor with tools,
    as in vLLM."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1
    )


class CompletionRequest(SamplingFields):
    """OpenAI's (legacy) completion request: every field of the openai SDK's
    ``completions.create`` (``best_of`` 1 only; ``suffix`` refused)."""

    prompt: Prompt
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    suffix: None = None


class GenerateTokensRequest(OpenAIBody):
    """vLLM's tokens-in, tokens-out request (``/inference/v1/generate``): prompt token
    ids and vLLM's ``SamplingParams`` as an object, read with the completion fields'
    names and ranges. ``model`` may be left out where one generation model is served.
    ``cache_salt`` and ``kv_transfer_params`` are accepted and change nothing."""

    token_ids: TokenIds = Field(min_length=1)
    sampling_params: dict[StrictStr, Any] = Field(default_factory=dict)
    model: StrictStr | None = None
    request_id: StrictStr | None = Field(default=None, max_length=256)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: StrictStr | None = None
    kv_transfer_params: dict[StrictStr, Any] | None = None


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


class PredictParameters(Strict):
    """huggingface_hub's ``text_classification`` parameters."""

    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = None
    top_k: StrictInt | None = Field(default=None, ge=1)


class PredictRequest(Strict):
    """TEI's predict request (``model`` is carpool's: which classifier, when several;
    ``parameters`` huggingface_hub's)."""

    inputs: TextOrTexts
    model: StrictStr | None = None
    parameters: PredictParameters | None = None
    raw_scores: StrictBool = False
    truncate: StrictBool = False
