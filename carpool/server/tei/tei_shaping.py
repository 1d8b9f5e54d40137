"""Text Embeddings Inference's responses: pure functions of what the models
computed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from carpool.version import __version__


def normalized(vectors: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Each row scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)


def cut_to(vectors: np.ndarray[Any, Any], dimensions: int | None) -> np.ndarray[Any, Any]:
    """The first ``dimensions`` of each vector (Matryoshka models), renormalized."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    return normalized(vectors[:, :dimensions])


def similarities(vectors: np.ndarray[Any, Any]) -> list[float]:
    """The cosine similarity of the first vector to each of the others."""
    unit = normalized(vectors.astype(np.float32))
    return [float(x) for x in unit[1:] @ unit[0]]


def rerank_body(
    texts: Sequence[str], scores: Sequence[float], return_text: bool
) -> list[dict[str, Any]]:
    """TEI's rerank answer: every text's index and score, best first (ties keep their
    order), with the text when asked."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [
        {"index": i, "score": float(scores[i]), **({"text": texts[i]} if return_text else {})}
        for i in order
    ]


def info_body(model_id: str, model_type: dict[str, Any], max_input_length: int) -> dict[str, Any]:
    """TEI's ``Info``."""
    return {
        "model_id": model_id,
        "model_sha": None,
        "model_dtype": "float32",
        "model_type": model_type,
        "max_concurrent_requests": 512,
        "max_input_length": max_input_length,
        "max_batch_tokens": 0,
        "max_batch_requests": None,
        "max_client_batch_size": 1024,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "router": "carpool",
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


def tokens_of(text: str, encoding: Any) -> list[dict[str, Any]]:
    """TEI's tokens of ``text`` from a ``tokenizers`` encoding: a special token is
    its own text and lies nowhere in the input; any other is the input's characters
    from ``start`` to ``stop``."""
    tokens = []
    for token_id, piece, special, (start, stop) in zip(
        encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets, strict=True
    ):
        if special:
            tokens.append(
                {"id": token_id, "text": piece, "special": True, "start": None, "stop": None}
            )
        else:
            tokens.append(
                {
                    "id": token_id,
                    "text": text[start:stop],
                    "special": False,
                    "start": start,
                    "stop": stop,
                }
            )
    return tokens
