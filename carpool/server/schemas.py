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
