"""Text Generation Inference's request bodies (``/generate``, ``/generate_stream``,
``/``), validated at the edge as TGI's router reads them: fields it does not define
are ignored (serde's default), the ones it defines are typed and ranged. ``model``
is carpool's: which generation model, when the server has several.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from carpool.server.generation.schemas import INT64_MAX, MAX_STOP_STRINGS, StopString


class _Lenient(BaseModel):
    """Unknown fields ignored, as TGI's router does; no NaN or Infinity."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TgiGrammar(_Lenient):
    """TGI's ``grammar``: a JSON schema (``json``: the schema, as an object or its
    text; ``json_schema``: ``{"name", "schema"}``) or a regular expression."""

    type: Literal["json", "regex", "json_schema"]
    value: Any


class TgiParameters(_Lenient):
    """TGI's ``GenerateParameters``."""

    adapter_id: StrictStr | None = None
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    decoder_input_details: StrictBool = False
    details: StrictBool = False
    do_sample: StrictBool = False
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    grammar: TgiGrammar | None = None
    max_new_tokens: StrictInt | None = Field(default=None, ge=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    return_full_text: StrictBool | None = None
    seed: StrictInt | None = Field(default=None, ge=0, le=INT64_MAX)
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(default=None, gt=0, le=100)
    top_k: StrictInt | None = Field(default=None, gt=0)
    top_n_tokens: StrictInt | None = Field(default=None, ge=1, le=20)
    top_p: float | None = Field(default=None, gt=0, le=1)
    truncate: StrictInt | None = Field(default=None, ge=1)
    typical_p: float | None = Field(default=None, gt=0, le=1)
    watermark: StrictBool = False


class TgiRequest(_Lenient):
    """TGI's ``GenerateRequest`` (and, with ``stream``, its ``CompatGenerateRequest``)."""

    inputs: StrictStr = Field(min_length=1)
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: StrictBool = False
    model: StrictStr | None = None
