"""Tiny random-weight models of each supported architecture, built with
``transformers`` and saved as Hugging Face folders, for architecture coverage."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "gpt2")
VOCAB = 512  # token ids below this decode with the built-in model's tokenizer


def hf_config(arch: str, vocab: int = VOCAB, sliding_window: int | None = None) -> Any:
    """``sliding_window``: Mistral's (all layers), Gemma 3's (its sliding layers) or
    Qwen3's (its second layer, by ``max_window_layers``); None keeps each default
    (Mistral and Qwen3 none, Gemma 3 past every test sequence)."""
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": vocab, "initializer_range": 0.2, "eos_token_id": 2}
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=2048, **common)
    llama_like: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        **common,
    )
    if arch == "llama":
        return tf.LlamaConfig(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            **llama_like,
        )
    if arch == "mistral":
        return tf.MistralConfig(
            sliding_window=sliding_window, tie_word_embeddings=True, **llama_like
        )
    if arch == "qwen2":
        return tf.Qwen2Config(tie_word_embeddings=True, **llama_like)
    if arch == "qwen3":  # q/k norms; a head_dim that is not hidden / heads; YaRN
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
        config = tf.Qwen3Config(
            tie_word_embeddings=True, head_dim=32, rope_scaling=yarn, **llama_like
        )
        if sliding_window is not None:  # layers from max_window_layers on are windowed
            config.use_sliding_window, config.sliding_window = True, sliding_window
            config.max_window_layers = 1
            config.layer_types = ["full_attention", "sliding_attention"]
        return config
    if arch == "phi3":  # fused qkv and gate_up in the checkpoint; LongRoPE's factors
        half = llama_like["hidden_size"] // llama_like["num_attention_heads"] // 2
        longrope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            # past every test sequence: transformers switches all positions to the
            # long factors once a sequence passes it, carpool position by position
            "original_max_position_embeddings": 512,
        }
        return tf.Phi3Config(
            tie_word_embeddings=False, rope_scaling=longrope, pad_token_id=0, **llama_like
        )
    if arch == "gemma3":  # sliding and global layers, each with its rotary settings
        return tf.Gemma3TextConfig(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=sliding_window or 512,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
            final_logit_softcapping=30.0,
            pad_token_id=0,
            bos_token_id=1,
            **llama_like,
        )
    raise ValueError(arch)


def build(
    arch: str,
    folder: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    vocab: int = VOCAB,
    sliding_window: int | None = None,
    **overrides: Any,
) -> Any:
    """Save a random ``arch`` model with the given tokenizer into ``folder``; return
    the transformers model (eval, float32). ``vocab``: its vocabulary (the whole
    tokenizer's where a grammar's forced tokens must be reachable); ``overrides``:
    config fields set after ``hf_config``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(arch, vocab, sliding_window)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return model


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS ignored (no masking: EOS may be chosen)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
