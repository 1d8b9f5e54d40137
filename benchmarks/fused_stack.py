"""The fused native stack against layer-by-layer steps on the same loaded model, one
stream on the CPU: random Q8_0 blocks in a real model's exact shape (Qwen3-0.6B,
Gemma-3-1B: their q/k norms, Gemma's four norms, GELU and two rotary tables, which
the stack runs since issue 27's session 20), laid out as carpool's GGUF conversion
lays a file out, with the built-in tokenizer widened to the vocabulary. The shapes
are ``benchmarks.real_size``'s (``qwen3-toy`` checks this module in seconds).

    python -m benchmarks.fused_stack --shape qwen3-0.6b --tokenizer DIR [--rounds 3]

Each round times 64 decoded tokens (after the first) with the stack, then with the
model's ``stack`` set aside (what these architectures ran before), so the CPU's
drift falls on both; the medians and their ratio are printed. Speed does not depend
on the weights' values (greedy, EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.real_size import SHAPES, widen_tokenizer

TOKENS = 64

# Shapes of benchmarks.real_size (Hugging Face config fields) this benchmark runs.
STACK_SHAPES = ("qwen3-0.6b", "gemma3-1b", "qwen3-toy")
ARCHS = {"qwen3": "qwen3", "gemma3_text": "gemma3"}  # model_type -> GGUF architecture


def q8_0_blocks(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, k / 32 * 34] Q8_0 rows: a float16 scale, then 32 int8 quants, per block;
    scales small enough that activations stay finite."""
    raw = rng.integers(0, 256, size=(n, k // 32, 34), dtype=np.uint8)
    scales = (0.002 * rng.uniform(0.5, 1.5, size=(n, k // 32))).astype(np.float16)
    raw[..., :2] = scales[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def write_gguf(shape: dict[str, Any], path: Path) -> None:
    """A GGUF file of random Q8_0 blocks in ``shape`` (a real_size.SHAPES entry)."""
    import gguf

    arch, h = ARCHS[shape["model_type"]], shape["hidden_size"]
    d, heads, kv_heads = (
        shape["head_dim"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    layers, inter = shape["num_hidden_layers"], shape["intermediate_size"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.get("rope_theta", 10000.0))
    writer.add_vocab_size(shape["vocab_size"])
    writer.add_eos_token_id(2)
    if "sliding_window" in shape:
        writer.add_sliding_window(shape["sliding_window"])
    rng = np.random.default_rng(0)
    q, kv = heads * d, kv_heads * d
    matrices = {
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
    }
    norms = ["attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"]
    if arch == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for layer in range(layers):
        for part in norms:
            size = d if part in ("attn_q_norm", "attn_k_norm") else h
            writer.add_tensor(f"blk.{layer}.{part}.weight", np.ones(size, np.float32))
        for part, (n, k) in matrices.items():
            raw = q8_0_blocks(n, k, rng)
            writer.add_tensor(
                f"blk.{layer}.{part}.weight", raw, raw_shape=raw.shape, raw_dtype=q8_0
            )
    raw = q8_0_blocks(shape["vocab_size"], h, rng)
    writer.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=q8_0)
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def lay_out(path: Path, folder: Path, tokenizer_dir: Path) -> None:
    """The file as ``carpool.models.causal_lm.convert_gguf`` lays one out, with the
    widened built-in tokenizer (this file has none)."""
    from carpool.models.causal_lm import save_converted

    folder.mkdir(parents=True, exist_ok=True)
    config = save_converted(path, folder, progress=False)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    widened = widen_tokenizer(tokenizer, config["vocab_size"])
    (folder / "tokenizer.json").write_text(json.dumps(widened, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(
        (tokenizer_dir / "tokenizer_config.json").read_text()
    )


def decode_seconds(llm: Any, prompt: str) -> float:
    """Seconds per decoded token of one stream, the first token's time taken out."""
    from carpool import SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate([prompt], first, use_tqdm=False)
    one = time.perf_counter() - started
    started = time.perf_counter()
    llm.generate([prompt], whole, use_tqdm=False)
    return (time.perf_counter() - started - one) / (TOKENS - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=STACK_SHAPES)
    parser.add_argument("--tokenizer", required=True, type=Path, help="the built-in's folder")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from carpool import LLM

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path, folder = Path(tmp) / f"{args.shape}.gguf", Path(tmp) / "converted"
        write_gguf(SHAPES[args.shape], path)
        lay_out(path, folder, args.tokenizer)
        path.unlink()
        llm = LLM(str(folder), enable_prefix_caching=False, kv_cache_memory="256MiB")
        model = llm.lm.model
        stack = model.stack
        assert stack is not None, model.stack_unused_because
        times: dict[str, list[float]] = {"fused": [], "layer by layer": []}
        decode_seconds(llm, "warm up")
        for i in range(args.rounds):
            prompt = f"Round {i}: the sea, the sky and the hills."
            for name, used in (("fused", stack), ("layer by layer", None)):
                model.stack = used
                times[name].append(decode_seconds(llm, prompt))
        model.stack = stack
    fused, plain = (1 / statistics.median(times[n]) for n in ("fused", "layer by layer"))
    print(
        f"{args.shape}, Q8_0 blocks, one stream, {args.threads} threads: fused stack "
        f"{fused:.1f} tok/s, layer by layer {plain:.1f} tok/s, ratio {fused / plain:.2f} "
        f"(medians of {args.rounds} alternating rounds of {TOKENS} tokens)"
    )
    print(
        f"reproduce: python -m benchmarks.fused_stack --shape {args.shape} "
        f"--tokenizer {args.tokenizer} --rounds {args.rounds}"
    )


if __name__ == "__main__":
    main()
