"""OpenAI-compatible routes: /v1/models and /v1/embeddings, and vLLM's /pooling over an
embedder."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from carpool.admission import refuse_oversized
from carpool.errors import InvalidRequest
from carpool.models.embedding import EmbeddingModel
from carpool.server.generation.schemas import EmbeddingRequest, PoolingRequest
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.registry.preprocess import Keep, Preprocessor, TooManyTokens, encode_within
from carpool.server.registry.served import ServedEmbedding, ServedModels
from carpool.server.tasks.task_routes import model_for, run_rows

MAX_INPUTS = 2048


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every served model, and each alias of one under its own id (as vLLM lists
        every --served-model-name)."""
        cards = [_card(m.name, m.created) for m in models.all()]
        created = {m.name: m.created for m in models.all()}
        cards += [_card(a, created[n]) for a, n in models.aliases.items() if n in created]
        return {"object": "list", "data": cards}

    @api.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        return _card(model_id, models.any(model_id).created)

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        name, vectors, usage = await embed_request(models, body, request)
        return embeddings_response(name, vectors, body.encoding_format, usage)

    @api.post("/pooling")
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        """vLLM's pooling API over an embedder: its pooled vector per input."""
        if body.messages is not None:
            raise InvalidRequest(
                "an embedder here has no chat template; send the text as 'input'",
                param="messages",
            )
        if body.input is None:
            raise InvalidRequest("give the texts to pool as 'input'", param="input")
        # The fields were checked as the embeddings' are (same types, same ranges).
        as_embedding = EmbeddingRequest.model_construct(
            model=body.model,
            input=body.input,
            encoding_format=body.encoding_format,
            priority=body.priority,
            timeout=body.timeout,
            truncate=body.truncate,
        )
        name, vectors, usage = await embed_request(models, as_embedding, request)
        return pooling_response(name, vectors, body.encoding_format, usage)

    return api


async def embed_request(
    models: ServedModels, body: EmbeddingRequest, request: Request
) -> tuple[str, list[Any], dict[str, int] | None]:
    """The embeddings ``body`` asks for: the model's name, a vector per input, and
    the usage (None where the model's library tokenizes and carpool cannot count)."""
    if models.is_user(body.model):
        return await _user_embeddings(models, body, request)
    served = models.embedder(body.model)
    if body.dimensions is not None and body.dimensions != served.model.dimensions:
        raise InvalidRequest(
            f"model {served.name!r} has {served.model.dimensions} dimensions and cannot "
            f"return {body.dimensions}",
            param="dimensions",
        )
    ids = await tokenize_inputs(served, body.input, body.truncate, models.preprocess)
    vectors = await served.embed(
        ids, priority=body.priority, timeout_s=body.timeout, request=request
    )
    tokens = sum(len(x) for x in ids)
    return served.name, vectors, {"prompt_tokens": tokens, "total_tokens": tokens}


def _card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "carpool"}


def pooling_response(
    model: str, vectors: Iterable[Any], encoding_format: str, usage: dict[str, int] | None
) -> Response:
    """vLLM's pooling body for ``vectors``."""
    data = [
        {"index": i, "object": "pooling", "data": encode(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    payload: dict[str, Any] = {
        "id": f"pool-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage,
    }
    return Response(
        orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


def embeddings_response(
    model: str, vectors: Iterable[Any], encoding_format: str, usage: dict[str, int] | None
) -> Response:
    """OpenAI's embeddings body for ``vectors`` (``usage`` left out when None)."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
        for i, v in enumerate(vectors)
    ]
    payload: dict[str, Any] = {"object": "list", "data": data, "model": model}
    if usage is not None:
        payload["usage"] = usage
    return Response(
        orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


async def _user_embeddings(
    models: ServedModels, body: EmbeddingRequest, request: Request
) -> tuple[str, list[Any], None]:
    """Embeddings from a repository embedder (sentence-transformers): texts only. No
    usage: the embedder tokenizes inside its library, so carpool has no count."""
    served = model_for(models, body.model, "embed")
    items = [body.input] if isinstance(body.input, str) else body.input
    texts = [t for t in items if isinstance(t, str) and t]
    if not texts or len(texts) != len(items):
        raise InvalidRequest(
            f"model {body.model!r} takes a text or a list of non-empty texts", param="input"
        )
    if body.dimensions is not None:
        raise InvalidRequest("this model does not take 'dimensions'", param="dimensions")
    out = await run_rows(
        served,
        {"text": texts},
        priority=body.priority,
        timeout_s=body.timeout,
        request=request,
    )
    return served.name, list(out["embedding"]), None


async def tokenize_inputs(
    served: ServedEmbedding,
    inputs: str | list[str] | list[int] | list[list[int]],
    truncate: bool,
    preprocess: Preprocessor,
) -> list[list[int]]:
    """Token ids of each input; a flat list of ints is one input of token ids. Texts
    are tokenized on the pre-processing pool."""
    if isinstance(inputs, str):
        return await preprocess.run(tokenize_texts, served.model, [inputs], truncate, "input")
    if not inputs:
        raise InvalidRequest("input must not be an empty list", param="input")
    check_input_count(served, len(inputs))
    first = inputs[0]
    if isinstance(first, int):
        return [served.model.check_ids(inputs, truncate)]  # type: ignore[arg-type]
    if isinstance(first, str):
        return await preprocess.run(tokenize_texts, served.model, inputs, truncate, "input[{}]")  # type: ignore[arg-type]
    return [
        served.model.check_ids(ids, truncate, param=f"input[{i}]")  # type: ignore[arg-type]
        for i, ids in enumerate(inputs)
    ]


def check_input_count(served: ServedEmbedding, count: int) -> None:
    """Refuse (413) a request with more inputs than one request may bring."""
    most = min(MAX_INPUTS, served.batcher.max_request_inputs())
    refuse_oversized(count, most, what="items", taker=f"model {served.name!r}", param="input")


def tokenize_texts(
    model: EmbeddingModel, texts: list[str], truncate: bool, param: str
) -> list[list[int]]:
    """Token ids of each text, fitted to the model's maximum (``param`` names text
    ``i`` as ``param.format(i)``). Refuses a text far over the maximum without
    tokenizing all of it."""
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest("input must not be empty", param=param.format(i))
    keep: Keep = "head" if truncate else "all"
    try:
        ids = encode_within(model.encode_batch, texts, model.max_length, keep)
    except TooManyTokens as exc:
        raise InvalidRequest(
            f"input has more than {exc.limit} tokens, over this model's maximum of "
            f"{model.max_length}; shorten it or ask for truncation",
            param=param.format(exc.index),
        ) from None
    return [model.fit(x, truncate, param.format(i)) for i, x in enumerate(ids)]


def encode(vector: np.ndarray[Any, Any], encoding_format: str) -> np.ndarray[Any, Any] | str:
    """The vector as base64 of little-endian float32, or as the float32 array itself
    (orjson writes each element's shortest exact float32 form)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32, copy=False)
