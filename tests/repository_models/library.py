"""Tiny random-weight models for the library kinds (pipelines, cross-encoders), each
saved in Hugging Face's layout with the built-in embedder's tokenizer, and the
carpool.toml that serves it."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    ViTConfig,
    ViTForImageClassification,
    ViTImageProcessor,
)

from carpool.models.registry import BUILTIN_MODELS

SENTIMENT = {0: "negative", 1: "neutral", 2: "positive"}
NLI = {0: "entailment", 1: "neutral", 2: "contradiction"}


def _bert(**extra: object) -> BertConfig:
    return BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        **extra,
    )


def _save(model: torch.nn.Module, folder: Path) -> Path:
    torch.manual_seed(0)
    model.save_pretrained(folder)  # type: ignore[operator]
    AutoTokenizer.from_pretrained(BUILTIN_MODELS["all-minilm-l6-v2"].locate()).save_pretrained(
        folder
    )
    return folder


def _labels(names: dict[int, str]) -> dict[str, object]:
    return {"id2label": names, "label2id": {v: k for k, v in names.items()}}


def build_library_models(root: Path, weights: Path) -> dict[str, Path]:
    """Save the tiny models under ``weights`` and a model for each under ``root``; the
    weight folders by model name."""
    torch.manual_seed(0)
    folders = {
        "reranker": _save(BertForSequenceClassification(_bert(num_labels=1)), weights / "ce"),
        "sentiment": _save(
            BertForSequenceClassification(_bert(num_labels=3, **_labels(SENTIMENT))), weights / "tc"
        ),
        "entities": _save(
            BertForTokenClassification(_bert(num_labels=3, **_labels(SENTIMENT))), weights / "tok"
        ),
        "masks": _save(BertForMaskedLM(_bert()), weights / "mlm"),
        "features": _save(BertModel(_bert()), weights / "fe"),
        "zero_shot": _save(
            BertForSequenceClassification(_bert(num_labels=3, **_labels(NLI))), weights / "nli"
        ),
        "embedder": Path(BUILTIN_MODELS["all-minilm-l6-v2"].locate()),
    }
    vit = ViTForImageClassification(
        ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=3,
            **_labels(SENTIMENT),
        )
    )
    vit.save_pretrained(weights / "vit")
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(weights / "vit")
    folders["images"] = weights / "vit"
    kinds = {
        "reranker": ("cross_encoder", ""),
        "sentiment": ("pipeline", "text-classification"),
        "entities": ("pipeline", "token-classification"),
        "masks": ("pipeline", "fill-mask"),
        "features": ("pipeline", "feature-extraction"),
        "zero_shot": ("pipeline", "zero-shot-classification"),
        "embedder": ("sentence_transformer", ""),
        "images": ("pipeline", "image-classification"),
    }
    for name, (kind, task) in kinds.items():
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "carpool.toml").write_text(
            textwrap.dedent(
                f"""
                max_batch_size = 16
                source = {{ kind = "{kind}", task = "{task}", path = "{folders[name]}" }}
                batching = {{ max_queue_delay_ms = 5 }}
                """
            )
        )
    return folders


def png(seed: int) -> bytes:
    """A small random RGB image, PNG-encoded."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (40, 40, 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()
