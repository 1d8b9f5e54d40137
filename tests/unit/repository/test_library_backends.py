"""The sentence-transformers backends: the library's answers, without its per-call
walks of the module tree (a one-pair call's largest cost outside the model)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import BertForSequenceClassification

from carpool.models.registry import BUILTIN_MODELS
from carpool.repository.library_models import CrossEncoderBackend, SentenceTransformerBackend
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import Source
from tests.repository_models.library import _bert, _save

PAIRS = [("what is the capital of France?", "Paris."), ("what is up?", "Bananas are yellow.")]


def _column(values: list[str]) -> np.ndarray[Any, Any]:
    return np.array([[v.encode()] for v in values], dtype=np.object_)


def _walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each ``Module.train`` (what ``eval`` walks the tree with) and
    ``Module.parameters`` call from now on."""
    calls: list[str] = []
    train, parameters = torch.nn.Module.train, torch.nn.Module.parameters

    def counted_train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        calls.append("train")
        return train(self, mode)

    def counted_parameters(self: torch.nn.Module, recurse: bool = True) -> Any:
        calls.append("parameters")
        return parameters(self, recurse)

    monkeypatch.setattr(torch.nn.Module, "train", counted_train)
    monkeypatch.setattr(torch.nn.Module, "parameters", counted_parameters)
    return calls


def test_a_cross_encoder_batch_scores_as_predict_without_walking_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _save(BertForSequenceClassification(_bert(num_labels=1)), tmp_path / "ce")
    expected = CrossEncoder(str(folder)).predict(PAIRS)
    source = Source("cross_encoder", str(folder))
    backend = CrossEncoderBackend(SimpleNamespace(source=source), 0, "cpu")  # type: ignore[arg-type]
    calls = _walks(monkeypatch)
    payload = TensorPayload(
        {"query": _column([q for q, _ in PAIRS]), "document": _column([d for _, d in PAIRS])}
    )
    (out,) = backend.execute([payload])
    assert calls == []
    assert not backend.model.training
    np.testing.assert_allclose(out["score"].reshape(-1), expected, rtol=1e-6)  # type: ignore[index]


def test_an_embedder_batch_encodes_as_encode_without_walking_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = str(BUILTIN_MODELS["all-minilm-l6-v2"].locate())
    texts = ["a good day", "a bad, bad day"]
    expected = SentenceTransformer(folder).encode(texts)
    source = Source("sentence_transformer", folder)
    backend = SentenceTransformerBackend(SimpleNamespace(source=source), 0, "cpu")  # type: ignore[arg-type]
    calls = _walks(monkeypatch)
    (out,) = backend.execute([TensorPayload({"text": _column(texts)})])
    assert calls == []
    np.testing.assert_allclose(out["embedding"], expected, rtol=1e-5, atol=1e-6)  # type: ignore[index]
