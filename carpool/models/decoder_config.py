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
GEMMA3_FAMILY = ("Gemma3ForCausalLM",)
SUPPORTED = LLAMA_FAMILY + GEMMA3_FAMILY + GPT2_FAMILY


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
    # Attention over the last this many positions only (Mistral, Phi-3, Gemma 3's
    # sliding layers, Qwen2/3 with use_sliding_window): a query at position p sees
    # keys p - window + 1 ... p, as transformers' sliding-window mask.
    sliding_window: int | None = None
    # Each layer's kind (sliding_attention or full_attention; empty: every layer is
    # windowed where a window is set), and for Gemma 3 the rotary
    # settings of its sliding layers, query_pre_attn_scalar ** -0.5, and the cap on
    # the final logits (tanh soft-capping) where one is set.
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = 10000.0
    local_rope_scaling: Mapping[str, Any] = field(default_factory=dict)
    attention_scale: float | None = None
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} is not a positive size")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )

    @property
    def max_context(self) -> int:
        """The longest sequence served: the positions the model knows."""
        return self.max_position_embeddings

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None where it attends the whole context."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    def hybrid_window(self) -> int | None:
        """The sliding layers' window where the other layers attend the whole context
        (Gemma 3; Qwen2/3 with ``max_window_layers``); None where every layer attends
        alike."""
        windows = self.layer_windows()
        return self.sliding_window if None in windows and any(windows) else None

    @property
    def is_gpt2(self) -> bool:
        return self.architecture in GPT2_FAMILY

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """From a ``config.json`` of a supported architecture."""
        archs = [a for a in config.get("architectures") or [] if a in SUPPORTED]
        if not archs:
            raise ValueError(
                f"no supported architecture in {config.get('architectures')!r} "
                f"(supported: {', '.join(SUPPORTED)})"
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
        partial = float(
            config.get("partial_rotary_factor")
            or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
            or 1
        )
        if partial != 1:
            raise ValueError(f"a partial rotary embedding ({partial}) is not supported")
        common: dict[str, Any] = dict(
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
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(config),
        )
        if arch in GEMMA3_FAMILY:
            return cls(**{**common, **_gemma3(config)})
        theta, scaling = _rope(config.get("rope_parameters") or config.get("rope_scaling"), config)
        return cls(
            **common,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_theta=theta,
            rope_scaling=scaling,
            layer_types=_layer_types(config, int(config["num_hidden_layers"])),
        )


def _rope(
    params: Mapping[str, Any] | None, config: Mapping[str, Any], theta_key: str = "rope_theta"
) -> tuple[float, dict[str, Any]]:
    """The rotary base and scaling of ``params`` (transformers 5 writes them under
    ``rope_parameters``; 4.x at the top level: ``theta_key`` and ``rope_scaling``)."""
    rope = dict(params or {})
    theta = float(rope.get("rope_theta") or config.get(theta_key) or 10000.0)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_KINDS)})")
    original = config.get("original_max_position_embeddings")
    if original is not None:  # Phi-3 writes it beside rope_scaling
        rope.setdefault("original_max_position_embeddings", original)
    return theta, {} if kind == "default" else {**rope, "rope_type": kind}


def _gemma3(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's own fields: layer kinds, the two rotary settings, the scale."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types")
    if not kinds:  # 4.x configs: every sliding_window_pattern-th layer is global
        pattern = int(config.get("sliding_window_pattern") or 6)
        kinds = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set per layer kind
        full = _rope(params["full_attention"], config)
        local = _rope(params.get("sliding_attention"), {"rope_theta": 10000.0})
    else:
        full = _rope(config.get("rope_scaling"), config)
        local = _rope(None, config, theta_key="rope_local_base_freq")
    if config.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
    cap = config.get("final_logit_softcapping")
    return dict(
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        qk_norm=True,
        rope_theta=full[0],
        rope_scaling=full[1],
        layer_types=tuple(kinds),
        local_rope_theta=local[0],
        local_rope_scaling=local[1],
        attention_scale=float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_logit_softcap=None if cap is None else float(cap),
    )


def _layer_types(config: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Which layers are windowed, where not all are: the config's list, or Qwen2/3's
    rule (layers from ``max_window_layers`` on)."""
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    if config.get("use_sliding_window") and config.get("max_window_layers") is not None:
        first = int(config["max_window_layers"])
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    return ()


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window a model's attention keeps, where it applies (Qwen2/3 name one they
    do not use unless ``use_sliding_window``)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    return int(window)
