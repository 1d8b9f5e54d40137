"""Text Embeddings Inference's API over carpool's embedders: ``POST /embed``
(``huggingface_hub``'s ``feature_extraction`` pointed at it), ``POST /embed_all``
(every token's state), ``POST /similarity`` (its ``sentence_similarity``) and ``POST
/decode``; TEI's ``/tokenize`` body is told from vLLM's on the one ``/tokenize`` route
(``generation_routes``) and answered by ``tokenize``; TEI's ``/rerank`` body and
``/predict`` are served by ``task_routes``, TEI's ``/info`` by ``tgi_routes`` where no
model generates. Errors in TEI's shape (``errors``).

An adapter over the embeddings path: the built-in embedders' tokenizer and batcher,
or a repository sentence-transformers model's rows, as ``/v1/embeddings`` runs them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from carpool.errors import InvalidRequest
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.openai.openai_routes import tokenize_inputs
from carpool.server.registry.served import ServedEmbedding, ServedModels, the_only
from carpool.server.registry.served_user import ServedUserModel
from carpool.server.tasks.task_routes import does, model_for, run_rows
from carpool.server.tei.tei_schemas import (
    DecodeRequest,
    EmbedAllRequest,
    EmbedRequest,
    SimilarityRequest,
    TeiTokenizeRequest,
)
from carpool.server.tei.tei_shaping import (
    cut_to,
    info_body,
    normalized,
    similarities,
    tokens_of,
)

Embedder = ServedEmbedding | ServedUserModel


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/embed")
    async def embed(body: EmbedRequest, request: Request) -> Response:
        served = the_embedder(models, body.model)
        _right_only(body.truncation_direction)
        texts = _prompted(served, _listed(body.inputs), body.prompt_name)
        vectors = await embed_texts(models, served, texts, bool(body.truncate), request)
        vectors = cut_to(normalized(vectors) if body.normalize else vectors, body.dimensions)
        return Response(
            orjson.dumps(vectors.astype(np.float32), option=orjson.OPT_SERIALIZE_NUMPY),
            media_type="application/json",
        )

    @api.post("/embed_all")
    async def embed_all(body: EmbedAllRequest, request: Request) -> Response:
        """Each input's token states (the encoder's last layer, neither pooled nor
        normalised), ``[inputs][tokens][hidden]``."""
        served = _tokenizing(the_embedder(models, body.model), "give token states")
        _right_only(body.truncation_direction)
        texts = _prompted(served, _listed(body.inputs), body.prompt_name)
        ids = await tokenize_inputs(served, texts, bool(body.truncate), models.preprocess)
        states = await served.embed(ids, request=request, token_states=True)
        return Response(
            orjson.dumps([s.astype(np.float32) for s in states], option=orjson.OPT_SERIALIZE_NUMPY),
            media_type="application/json",
        )

    @api.post("/similarity")
    async def similarity(body: SimilarityRequest, request: Request) -> list[float]:
        served = the_embedder(models, body.model)
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        return similarities(await embed_texts(models, served, texts, False, request))

    @api.post("/decode")
    async def decode(body: DecodeRequest) -> list[str]:
        """Token ids back to text with the embedder's tokenizer, one text per sequence."""
        served = _tokenizing(the_embedder(models, body.model), "decode ids")
        ids = body.ids
        batch: list[list[int]] = (
            [row for row in ids if isinstance(row, list)]
            if ids and isinstance(ids[0], list)
            else [[i for i in ids if isinstance(i, int)]]
        )
        vocabulary = served.model.vocab_size
        for row in batch:
            bad = [i for i in row if not 0 <= i < vocabulary]  # checked before the C side
            if bad:
                raise InvalidRequest(
                    f"token id {bad[0]} is outside the vocabulary (0..{vocabulary - 1})",
                    param="ids",
                )
        decoded: list[str] = served.model.tokenizer.decode_batch(
            batch, skip_special_tokens=body.skip_special_tokens
        )
        return decoded

    return api


async def tokenize(models: ServedModels, body: TeiTokenizeRequest) -> list[list[dict[str, Any]]]:
    """TEI's ``/tokenize``: each input's tokens (id, text, whether special, and where
    it lies in the input), with the embedder's tokenizer."""
    served = _tokenizing(the_embedder(models, body.model), "tokenize")
    texts = _prompted(served, _listed(body.inputs), body.prompt_name)
    tokenizer = served.model.tokenizer
    encodings = await models.preprocess.run(
        tokenizer.encode_batch, texts, add_special_tokens=body.add_special_tokens
    )
    return [tokens_of(text, e) for text, e in zip(texts, encodings, strict=True)]


def _tokenizing(served: Embedder, task: str) -> ServedEmbedding:
    """``served``, which must be an embedder carpool tokenizes for (a repository
    model's library tokenizes inside itself)."""
    if not isinstance(served, ServedEmbedding):
        raise InvalidRequest(
            f"model {served.name!r} tokenizes inside its library; it cannot {task}",
            param="model",
        )
    return served


def _listed(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else inputs


def _right_only(direction: str) -> None:
    if direction.lower() == "left":
        raise InvalidRequest(
            "truncation_direction Left is not supported; inputs are cut on the right",
            param="truncation_direction",
        )


def the_embedder(models: ServedModels, name: str | None) -> Embedder:
    """The embedder ``name`` (built-in or a repository sentence-transformers model), or
    the server's only one; else 400 naming them."""
    if name is not None:
        return model_for(models, name, "embed") if models.is_user(name) else models.embedder(name)
    found: list[Embedder] = [*models]
    found += [m for m in models.user_models.values() if does(m, "embed")]
    return the_only(found, "embeddings")


def embedder_info(served: Embedder) -> dict[str, Any]:
    """TEI's ``/info`` for an embedder."""
    # A repository embedder tokenizes inside its library: carpool knows no maximum.
    max_length = served.model.max_length if isinstance(served, ServedEmbedding) else 0
    return info_body(served.name, {"embedding": {"pooling": "mean"}}, max_length)


async def embed_texts(
    models: ServedModels, served: Embedder, texts: list[str], truncate: bool, request: Request
) -> np.ndarray[Any, Any]:
    """One vector per text, as the model's own pipeline gives it."""
    if isinstance(served, ServedEmbedding):
        ids = await tokenize_inputs(served, texts, truncate, models.preprocess)
        return np.stack(await served.embed(ids, request=request))
    out = await run_rows(served, {"text": texts}, request=request, truncate=truncate)
    return np.asarray(out["embedding"], np.float32)


def _prompted(served: Embedder, texts: list[str], prompt_name: str | None) -> list[str]:
    """``texts`` after the model's named prompt (sentence-transformers' ``prompts``)."""
    if prompt_name is None:
        return texts
    prompts = served.model.prompts if isinstance(served, ServedEmbedding) else {}
    if prompt_name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest(
            f"model {served.name!r} has no prompt {prompt_name!r} (its prompts: {known})",
            param="prompt_name",
        )
    return [prompts[prompt_name] + t for t in texts]
