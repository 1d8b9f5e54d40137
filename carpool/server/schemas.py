"""Request bodies, validated at the edge with pydantic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, plus carpool's ``priority``, ``timeout`` and
    TEI's ``truncate``."""

    model: StrictStr
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    priority: StrictInt | None = Field(default=None, description="Priority level; 1 runs first.")
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the request may wait in the queue (shortens the default).",
    )
    truncate: bool = Field(
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


class V2InferRequest(BaseModel):
    """The Open Inference Protocol's inference request (JSON part)."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[V2Tensor] = Field(min_length=1)
    outputs: list[V2RequestedOutput] | None = None


Stop = StrictStr | list[StrictStr] | None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Strict):
    """The sampling fields shared by chat and completions: OpenAI's, vLLM's extras,
    and carpool's ``priority`` and ``timeout``."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stop: Stop = None
    seed: StrictInt | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    user: StrictStr | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)
    priority: StrictInt = Field(default=0, description="Lower runs first (vLLM's meaning).")
    timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds the request may wait to start (shortens the server's default).",
    )


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None


class ChatCompletionRequest(SamplingFields):
    """OpenAI's chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    """OpenAI's (legacy) completion request."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    suffix: None = None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the template."""

    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: StrictStr
    tokens: TokenIds
