"""Text Embeddings Inference's request bodies (``/embed``, ``/similarity``,
``/decode``, TEI's ``/rerank``), validated at the edge as TEI's router reads them:
fields it does not define are ignored, the ones it defines typed. ``model`` is
carpool's: which model, when the server has several that do the task.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from carpool.server.generation.schemas import MAX_TASK_ITEMS, TaskText

Texts = TaskText | Annotated[list[TaskText], Field(min_length=1, max_length=MAX_TASK_ITEMS)]
Direction = Literal["Right", "Left", "right", "left"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class EmbedRequest(_Lenient):
    """TEI's embed request (and huggingface_hub's ``feature_extraction`` body)."""

    inputs: Texts
    normalize: StrictBool = True
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: StrictStr | None = None
    dimensions: StrictInt | None = Field(default=None, ge=1)
    model: StrictStr | None = None


class EmbedAllRequest(_Lenient):
    """TEI's embed_all request: every token's state, not pooled."""

    inputs: Texts
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: StrictStr | None = None
    model: StrictStr | None = None


class TeiTokenizeRequest(_Lenient):
    """TEI's tokenize request (told from vLLM's, which has no ``inputs``)."""

    inputs: Texts
    add_special_tokens: StrictBool = True
    prompt_name: StrictStr | None = None
    model: StrictStr | None = None


class SimilarityInputs(_Lenient):
    source_sentence: TaskText
    sentences: Annotated[list[TaskText], Field(min_length=1, max_length=MAX_TASK_ITEMS)]


class SimilarityRequest(_Lenient):
    """TEI's similarity request (huggingface_hub's ``sentence_similarity`` body)."""

    inputs: SimilarityInputs
    model: StrictStr | None = None


class TeiRerankRequest(_Lenient):
    """TEI's rerank request: ``texts`` (Cohere's body has ``documents``)."""

    query: TaskText
    texts: Annotated[list[TaskText], Field(min_length=1, max_length=MAX_TASK_ITEMS)]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = None
    truncation_direction: Direction = "Right"
    model: StrictStr | None = None


Ids = list[StrictInt]


class DecodeRequest(_Lenient):
    """TEI's decode request: token ids (one sequence or several) back to text."""

    ids: (
        Annotated[Ids, Field(max_length=65536)]
        | Annotated[list[Ids], Field(min_length=1, max_length=MAX_TASK_ITEMS)]
    )
    skip_special_tokens: StrictBool = True
    model: StrictStr | None = None
