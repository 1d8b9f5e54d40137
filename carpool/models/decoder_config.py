"""The shape of a decoder-only language model, read once from a Hugging Face config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# The rotary scalings ``carpool.models.rope`` computes.
ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# Hugging Face architecture name -> our family.
LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
GPT2_FAMILY = ("GPT2LMHeadModel",)


@dataclass(frozen=True)
class DecoderConfig:
    """What our model code needs to know about a decoder (Llama family or GPT-2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's query and key (Qwen3)
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    # Attention over the last this many positions only (Mistral, Phi-3): not built
    # yet, so a model that has one serves contexts within it (``max_context``).
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def max_context(self) -> int:
        """The longest sequence served: the positions the model knows, within its
        sliding window where it has one (windowed attention is not built yet)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def is_gpt2(self) -> bool:
        return self.architecture in GPT2_FAMILY

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """From a ``config.json`` of a supported architecture."""
        archs = [a for a in config.get("architectures") or [] if a in LLAMA_FAMILY + GPT2_FAMILY]
        if not archs:
            raise ValueError(
                f"no supported architecture in {config.get('architectures')!r} "
                f"(supported: {', '.join(LLAMA_FAMILY + GPT2_FAMILY)})"
            )
        arch = archs[0]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if arch in GPT2_FAMILY:
            hidden = int(config["n_embd"])
            heads = int(config["n_head"])
            return cls(
                architecture=arch,
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(config["n_layer"]),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=int(config.get("n_inner") or 4 * hidden),
                max_position_embeddings=int(config["n_positions"]),
                norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                tie_word_embeddings=True,
                attention_bias=True,
                eos_token_ids=eos_ids,
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        # transformers 5 writes rope settings under rope_parameters; 4.x used
        # rope_theta and rope_scaling at the top level.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name
        if rope_type not in ROPE_KINDS:
            raise ValueError(
                f"rope scaling {rope_type!r} is not supported ({', '.join(ROPE_KINDS)})"
            )
        partial = float(
            rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1
        )
        if partial != 1:
            raise ValueError(f"a partial rotary embedding ({partial}) is not supported")
        if "original_max_position_embeddings" in config:
            rope.setdefault(
                "original_max_position_embeddings", config["original_max_position_embeddings"]
            )
        scaling = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_theta=theta,
            rope_scaling=scaling,
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(config),
        )


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window a model's attention keeps, where it applies (Qwen2/3 name one they
    do not use unless ``use_sliding_window``)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    return int(window)
