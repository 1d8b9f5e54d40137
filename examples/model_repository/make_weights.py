"""Write tiny random-weight models for this example's reranker and sentiment pipeline
into ./weights (no network: the tokenizer is the built-in embedder's). Their answers
are meaningless; they show the serving, not the model. Put real model folders there
to serve real models."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from carpool.models.registry import BUILTIN_MODELS

LABELS = {0: "negative", 1: "positive"}


def tiny_classifier(folder: Path, labels: dict[int, str]) -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=len(labels),
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_MODELS["all-minilm-l6-v2"].locate())
    tokenizer.save_pretrained(folder)


def main(root: Path) -> None:
    tiny_classifier(root / "weights" / "reranker", {0: "LABEL_0"})
    tiny_classifier(root / "weights" / "sentiment", LABELS)
    print(f"wrote {root / 'weights'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
