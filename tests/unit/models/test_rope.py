"""Every rotary scaling carpool reads gives transformers' own frequencies and cos/sin
factor (``ROPE_INIT_FUNCTIONS``), position by position; what is not supported is a
clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from carpool.models.decoder_config import DecoderConfig
from carpool.models.rope import rope_tables

HEAD, MAX = 32, 2048
HALF = HEAD // 2
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 256,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
        "long_factor": [2.0 + 0.5 * i for i in range(HALF)],
        "original_max_position_embeddings": 512,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


def hf_config(scaling: dict[str, Any]) -> Any:
    return tf.LlamaConfig(
        hidden_size=HEAD * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX,
        rope_scaling={**scaling, "rope_theta": 10000.0},
    )


def hf_tables(scaling: dict[str, Any], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos/sin for positions below ``seq_len`` of a sequence that long,
    each angle once (transformers repeats them for a head's second half)."""
    config = hf_config(scaling)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq.float())
    return freqs.cos() * factor, freqs.sin() * factor


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_each_scaling_gives_transformers_tables(name: str) -> None:
    scaling = SCALINGS[name]
    cfg = DecoderConfig.from_hf(
        hf_config(scaling).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    )
    cos, sin = rope_tables(HEAD, MAX, cfg.rope_theta, cfg.rope_scaling)
    short = 300  # a sequence within every original context
    want_cos, want_sin = hf_tables(scaling, short)
    torch.testing.assert_close(cos[:short], want_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:short], want_sin, rtol=1e-5, atol=1e-5)
    if name == "longrope":  # past the original context: the long factors (float32
        # angles of positions near 1,500 differ in their last bits)
        long_cos, long_sin = hf_tables(scaling, 1500)
        torch.testing.assert_close(cos[512:1500], long_cos[512:], rtol=0, atol=1e-4)
        torch.testing.assert_close(sin[512:1500], long_sin[512:], rtol=0, atol=1e-4)
    if name != "dynamic":  # (dynamic changes nothing within the context)
        plain_cos, _ = rope_tables(HEAD, MAX, cfg.rope_theta, {})
        assert not torch.allclose(cos[:short], plain_cos[:short])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "not supported"),
        ({"partial_rotary_factor": 0.75}, "partial rotary"),
    ],
)
def test_what_is_not_supported_says_so(extra: dict[str, Any], message: str) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 8,
        **extra,
    }
    with pytest.raises(ValueError, match=message):
        DecoderConfig.from_hf(config)


def test_which_layers_a_sliding_window_narrows() -> None:
    base = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 8,
        "max_position_embeddings": 32768,
    }
    mistral = DecoderConfig.from_hf(base | {"sliding_window": 4096, "num_hidden_layers": 2})
    assert mistral.layer_windows() == (4096, 4096)
    assert mistral.max_context == 32768  # windowed attention serves every position
    assert DecoderConfig.from_hf(base | {"sliding_window": None}).layer_windows() == (None,)
    qwen = base | {
        "architectures": ["Qwen2ForCausalLM"],
        "sliding_window": 4096,
        "num_hidden_layers": 3,
        "max_window_layers": 2,
    }
    unused = DecoderConfig.from_hf(qwen | {"use_sliding_window": False})
    assert unused.layer_windows() == (None, None, None)
    used = DecoderConfig.from_hf(qwen | {"use_sliding_window": True})
    assert used.layer_windows() == (None, None, 4096)
    with pytest.raises(ValueError, match="sliding_window 0"):
        DecoderConfig.from_hf(base | {"sliding_window": 0})
    with pytest.raises(ValueError, match="layer_types names 1 layers"):
        DecoderConfig.from_hf(qwen | {"layer_types": ["full_attention"]})
