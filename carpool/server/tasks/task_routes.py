"""Task endpoints users already call, over repository models that do the task:
``/rerank`` and ``/v1/rerank`` (Cohere / Jina / vLLM), ``/v1/score`` and ``/score``
(vLLM), ``/classify`` (vLLM), ``/predict`` (a LitAPI model's, LitServe's route, where
the server serves one; else TEI's), ``/v1/models/NAME/predict`` (a LitAPI model by
name), and ``/v1/embeddings`` for a sentence-transformers embedder (``openai_routes``
hands it here).

Each is a thin adapter: it turns the body into rows of the model's tensors, runs
them through the model's batcher like any /v2 request (split into requests of at
most ``max_batch_size`` rows), and shapes the response with ``task_shaping``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import Discriminator, Tag, ValidationError

from carpool.errors import InvalidRequest
from carpool.repository.litapi import request_payload, response_body
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import check_inputs
from carpool.server.generation.schemas import (
    ClassifyRequest,
    PredictRequest,
    RerankRequest,
    ScoreRequest,
)
from carpool.server.http.awaiting import gather_or_cancel
from carpool.server.http.unicode_check import UnicodeCheckedRoute
from carpool.server.registry.served import ServedModels, the_only
from carpool.server.registry.served_user import ServedUserModel
from carpool.server.tasks.task_shaping import (
    classify_body,
    predict_body,
    rerank_body,
    score_body,
    score_pairs,
)
from carpool.server.tei.tei_schemas import TeiRerankRequest
from carpool.server.tei.tei_shaping import rerank_body as tei_rerank_body

# What each task needs of a model: its source kind (and pipeline task).
TASKS = {
    "rerank": {("cross_encoder", "")},
    "classify": {("pipeline", "text-classification")},
    "embed": {("sentence_transformer", "")},
}


def model_for(models: ServedModels, name: str, task: str) -> ServedUserModel:
    """The repository model ``name`` if it does ``task``; else ``InvalidRequest``."""
    served = models.user(name)
    if not does(served, task):
        raise InvalidRequest(f"model '{name}' does not do {task}", param="model")
    return served


async def run_rows(
    served: ServedUserModel,
    columns: dict[str, list[str]],
    *,
    priority: int | None = None,
    timeout_s: float | None = None,
    request: Request | None = None,
    truncate: bool = False,
) -> dict[str, np.ndarray[Any, Any]]:
    """Run rows of text columns (one row per item) through the model; every output,
    its rows in order. ``truncate``: a text over the model's limit is cut to it
    (else the request is refused, naming the limit)."""
    version = served.latest
    count = len(next(iter(columns.values())))
    step = max(1, version.spec.max_batch_size)
    parts = []
    for start in range(0, count, step):
        arrays = {
            name: np.array([[t.encode()] for t in texts[start : start + step]], np.object_)
            for name, texts in columns.items()
        }
        checked = check_inputs(version.spec, arrays)
        payload = TensorPayload(checked.arrays, parameters={"truncate": True} if truncate else {})
        parts.append(
            served.infer(
                version, checked, payload, priority=priority, timeout_s=timeout_s, request=request
            )
        )
    results = await gather_or_cancel([asyncio.ensure_future(p) for p in parts])
    return {name: np.concatenate([r[name] for r in results]) for name in results[0]}


def _texts(documents: list[Any]) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in documents]


def router(models: ServedModels) -> APIRouter:
    api = APIRouter(route_class=UnicodeCheckedRoute)

    @api.post("/rerank")
    @api.post("/v1/rerank")
    async def rerank(body: AnyRerank, request: Request) -> Any:
        if isinstance(body, TeiRerankRequest):
            return await _tei_rerank(models, body, request)
        served = model_for(models, body.model, "rerank")
        documents = _texts(body.documents)
        out = await run_rows(
            served,
            {"query": [body.query] * len(documents), "document": documents},
            priority=body.priority,
            timeout_s=body.timeout,
            request=request,
        )
        scores = out["score"].reshape(-1).tolist()
        return rerank_body(served.name, documents, scores, body.top_n, body.return_documents)

    @api.post("/score")
    @api.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        served = model_for(models, body.model, "rerank")
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="text_2") from None
        out = await run_rows(
            served,
            {"query": [a for a, _ in pairs], "document": [b for _, b in pairs]},
            priority=body.priority,
            timeout_s=body.timeout,
            request=request,
        )
        return score_body(served.name, out["score"].reshape(-1).tolist())

    @api.post("/classify")
    @api.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
        served = model_for(models, body.model, "classify")
        texts = [body.input] if isinstance(body.input, str) else body.input
        out = await run_rows(
            served, {"text": texts}, priority=body.priority, timeout_s=body.timeout, request=request
        )
        return classify_body(served.name, _labels(out), out["scores"].tolist())

    @api.post("/predict", response_model=None)
    async def predict(request: Request) -> Any:
        """A LitAPI model's predict where the server serves one (LitServe's route);
        else TEI's predict on a classifier."""
        raw = await request.body()
        lit = [m for m in models.user_models.values() if m.latest.spec.source.kind == "litapi"]
        if lit:
            return await _lit_predict(the_lit_api(lit), raw, request)
        try:
            body = PredictRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        return await _tei_predict(body, request)

    @api.post("/v1/models/{name}/predict", response_model=None)
    async def predict_named(name: str, request: Request) -> Response:
        """A LitAPI model's predict, by name."""
        served = models.user(name)
        if served.latest.spec.source.kind != "litapi":
            raise InvalidRequest(f"model '{name}' is not a LitAPI model", param="model")
        return await _lit_predict(served, await request.body(), request)

    async def _tei_predict(body: PredictRequest, request: Request) -> list[Any]:
        asked = body.parameters
        if body.raw_scores or (asked is not None and asked.function_to_apply == "none"):
            raise InvalidRequest(
                "raw_scores is not supported: carpool returns probabilities", param="raw_scores"
            )
        served = _the_one(models, body.model, "classify")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        out = await run_rows(served, {"text": texts}, request=request, truncate=body.truncate)
        answer = predict_body(_labels(out), out["scores"].tolist(), isinstance(body.inputs, str))
        top_k = None if asked is None else asked.top_k
        if top_k is None:
            return answer
        return answer[:top_k] if isinstance(body.inputs, str) else [a[:top_k] for a in answer]

    return api


def the_lit_api(lit: list[ServedUserModel]) -> ServedUserModel:
    """The server's one LitAPI model (``/predict`` is LitServe's single route)."""
    if len(lit) != 1:
        names = ", ".join(sorted(m.name for m in lit))
        raise InvalidRequest(
            f"this server has several LitAPI models ({names}); call /v1/models/NAME/predict",
            param="model",
        )
    return lit[0]


async def _lit_predict(served: ServedUserModel, raw: bytes, request: Request) -> Response:
    """Run a JSON request through a LitAPI model; its answer's JSON."""
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidRequest("the request body must be JSON") from None
    version = served.latest
    checked = check_inputs(version.spec, request_payload(raw))
    payload = TensorPayload(checked.arrays)
    out = await served.infer(
        version, checked, payload, priority=None, timeout_s=None, request=request
    )
    return Response(response_body(out), media_type="application/json")


def _rerank_kind(value: Any) -> str:
    """TEI's body names its documents ``texts``; Cohere's, Jina's and vLLM's
    ``documents``."""
    return "tei" if isinstance(value, dict) and "texts" in value else "cohere"


AnyRerank = Annotated[
    Annotated[RerankRequest, Tag("cohere")] | Annotated[TeiRerankRequest, Tag("tei")],
    Discriminator(_rerank_kind),
]


async def _tei_rerank(
    models: ServedModels, body: TeiRerankRequest, request: Request
) -> list[dict[str, Any]]:
    """TEI's rerank: every text's score against the query, best first."""
    if body.raw_scores:
        raise InvalidRequest(
            "raw_scores is not supported: carpool returns the model's activated scores",
            param="raw_scores",
        )
    served = _the_one(models, body.model, "rerank")
    out = await run_rows(
        served,
        {"query": [body.query] * len(body.texts), "document": body.texts},
        request=request,
        truncate=bool(body.truncate),
    )
    return tei_rerank_body(body.texts, out["score"].reshape(-1).tolist(), body.return_text)


def _labels(out: dict[str, np.ndarray[Any, Any]]) -> list[str]:
    return [label.decode() for label in out["labels"][0]]


def _the_one(models: ServedModels, name: str | None, task: str) -> ServedUserModel:
    """The repository model ``name`` if it does ``task``, or the server's only one that
    does; else 400 naming them."""
    if name is not None:
        return model_for(models, name, task)
    return the_only([m for m in models.user_models.values() if does(m, task)], task)


def does(served: ServedUserModel, task: str) -> bool:
    source = served.latest.spec.source
    return (source.kind, source.options.get("task", "")) in TASKS[task]
