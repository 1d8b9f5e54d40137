"""The two user models every peer serves, in plain torch and sentence-transformers
(importable in any peer's environment): a small MLP on 256 random features, and a
MiniLM-L6-sized CrossEncoder (random weights) scoring (query, document) pairs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

FEATURES = 256
CLASSES = 16
BATCH = 64


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, CLASSES),
    )
    return net.eval()


class Mlp:
    """Rows of FEATURES floats in, rows of CLASSES probabilities out."""

    def __init__(self) -> None:
        self.net = make_mlp()

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return torch.softmax(self.net(torch.from_numpy(rows)), dim=-1).numpy()


class Reranker:
    """(query, document) pairs in, relevance scores out."""

    def __init__(self, folder: Path) -> None:
        from sentence_transformers import CrossEncoder

        self.model = CrossEncoder(str(folder), device="cpu")

    def __call__(self, pairs: list[tuple[str, str]]) -> np.ndarray:
        return np.asarray(
            self.model.predict(pairs, batch_size=max(1, len(pairs)), show_progress_bar=False),
            np.float32,
        )


def make_reranker(folder: Path, tokenizer_from: Path) -> None:
    """A MiniLM-L6-sized BERT cross-encoder with random weights, saved to ``folder``."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig.from_pretrained(tokenizer_from)
    config.num_labels = 1
    BertForSequenceClassification(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)
