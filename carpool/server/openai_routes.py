"""OpenAI-compatible routes: /v1/models and /v1/embeddings."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from carpool.errors import InvalidRequest
from carpool.server.schemas import EmbeddingRequest
from carpool.server.served import ServedEmbedding, ServedModels

MAX_INPUTS = 2048


def router(models: ServedModels) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": m.created, "owned_by": "carpool"}
                for m in models.all()
            ],
        }

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        served = models.get(body.model)
        if body.dimensions is not None and body.dimensions != served.model.dimensions:
            raise InvalidRequest(
                f"model {served.name!r} has {served.model.dimensions} dimensions and cannot "
                f"return {body.dimensions}",
                param="dimensions",
            )
        ids = tokenize_inputs(served, body.input, body.truncate)
        vectors = await served.embed(
            ids, priority=body.priority, timeout_s=body.timeout, request=request
        )
        data = [
            {"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(x) for x in ids)
        payload = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Response(
            orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
        )

    return api


def tokenize_inputs(
    served: ServedEmbedding, inputs: str | list[str] | list[int] | list[list[int]], truncate: bool
) -> list[list[int]]:
    """Token ids of each input; a flat list of ints is one input of token ids."""
    if isinstance(inputs, str):
        return [served.model.tokenize(inputs, truncate)]
    if not inputs:
        raise InvalidRequest("input must not be an empty list", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequest(f"input has {len(inputs)} items; at most {MAX_INPUTS}", param="input")
    first = inputs[0]
    if isinstance(first, int):
        return [served.model.check_ids(inputs, truncate)]  # type: ignore[arg-type]
    if isinstance(first, str):
        return [
            served.model.tokenize(text, truncate, param=f"input[{i}]")  # type: ignore[arg-type]
            for i, text in enumerate(inputs)
        ]
    return [
        served.model.check_ids(ids, truncate, param=f"input[{i}]")  # type: ignore[arg-type]
        for i, ids in enumerate(inputs)
    ]


def encode(vector: np.ndarray[Any, Any], encoding_format: str) -> np.ndarray[Any, Any] | str:
    """The vector as base64 of little-endian float32, or as the float32 array itself
    (orjson writes each element's shortest exact float32 form)."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.astype(np.float32, copy=False)
