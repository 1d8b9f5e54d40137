"""The task endpoints' response bodies (rerank, score, classify, predict): pure
functions of the scores a model returned."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def rerank_body(
    model: str,
    documents: Sequence[str],
    scores: Sequence[float],
    top_n: int | None,
    return_documents: bool,
) -> dict[str, Any]:
    """Documents by falling relevance (ties keep their order), at most ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or len(scores)]
    results = [
        {
            "index": i,
            "relevance_score": float(scores[i]),
            **({"document": {"text": documents[i]}} if return_documents else {}),
        }
        for i in order
    ]
    return {"id": _id("rerank"), "model": model, "results": results}


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one against many, or pairwise; ``ValueError`` if the lists differ."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, "
            "or as many as text_2"
        )
    return list(zip(first, second, strict=True))


def score_body(model: str, scores: Sequence[float]) -> dict[str, Any]:
    return {
        "id": _id("score"),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
    }


def classify_body(
    model: str, labels: Sequence[str], probabilities: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """vLLM's classify response: each input's best label and every class's probability."""
    data = []
    for i, probs in enumerate(probabilities):
        best = max(range(len(probs)), key=lambda k: probs[k])
        data.append(
            {
                "index": i,
                "label": labels[best],
                "probs": [float(p) for p in probs],
                "num_classes": len(probs),
            }
        )
    return {
        "id": _id("classify"),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
    }


def predict_body(
    labels: Sequence[str], probabilities: Sequence[Sequence[float]], single: bool
) -> list[Any]:
    """TEI's predict response: per input, every label with its score, best first; a
    single input gets its list alone."""
    answers = [
        [
            {"score": float(p), "label": label}
            for p, label in sorted(zip(probs, labels, strict=True), key=lambda pair: -pair[0])
        ]
        for probs in probabilities
    ]
    return answers[0] if single else answers
