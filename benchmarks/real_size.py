"""Random-weight models of real models' exact shapes, for benchmarks at real size
without downloading weights (issue 29): the layer count, widths, heads, vocabulary and
rotary settings of each model's published ``config.json``, random bfloat16 weights, the
built-in model's byte-level tokenizer widened to the vocabulary.

    python -m benchmarks.real_size --shape qwen3-0.6b --tokenizer DIR --out DIR [--device cuda]

``--tokenizer``: a folder with ``tokenizer.json`` (the built-in model's, converted:
``carpool.models.causal_lm.convert_gguf``). Speed does not depend on the weights'
values: prompts are random ids and EOS is ignored, as in nano-vllm's benchmark.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

# Each model's config.json, the fields that set its shape and speed.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        sliding_window=512,
        query_pre_attn_scalar=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # TinyLlama-1.1B's layers with the built-in model's vocabulary (its tokenizer):
    # 1.17B parameters, the 1B-class K-quant file of benchmarks.k_quants --shape.
    "llama-1.2b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=49152,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # Two layers of Qwen3's kind at toy widths: checks this module on a CPU in seconds.
    "qwen3-toy": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=60000,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}


def widen_tokenizer(tokenizer: dict[str, Any], vocab: int) -> dict[str, Any]:
    """``tokenizer`` (a byte-level BPE ``tokenizer.json``) with plain word tokens
    ("Ġw<id>", decoding to " w<id>") added up to ``vocab`` ids, so that every id a model
    of that vocabulary picks decodes to text as a real token does. Ids it has stay."""
    widened = json.loads(json.dumps(tokenizer))
    table: dict[str, int] = widened["model"]["vocab"]
    taken = set(table.values()) | {t["id"] for t in widened.get("added_tokens", [])}
    start = max(taken) + 1
    if start > vocab:
        raise ValueError(f"the tokenizer has {start} ids, more than the model's {vocab}")
    for i in range(start, vocab):
        table[f"\u0120w{i}"] = i
    return widened


def build(shape: str, out: Path, tokenizer_dir: Path, device: str = "cpu", seed: int = 0) -> None:
    """Save a random bfloat16 model of ``shape`` with a tokenizer of its vocabulary
    into ``out`` (a Hugging Face folder carpool loads as any other)."""
    import transformers as tf

    fields = dict(SHAPES[shape])
    config = tf.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    widened = widen_tokenizer(tokenizer, config.vocab_size)
    (out / "tokenizer.json").write_text(json.dumps(widened, ensure_ascii=False))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cpu", help="where the random weights are drawn")
    args = parser.parse_args()
    build(args.shape, args.out, args.tokenizer, args.device)
    print(f"{args.shape}: {args.out}")


if __name__ == "__main__":
    main()
