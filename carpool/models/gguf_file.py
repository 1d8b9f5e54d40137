"""Reading a GGUF file as a Hugging Face checkpoint: a ``config.json``-shaped dict
and Hugging Face-named float tensors, dequantized with the ``gguf`` package.

Supported: the ``llama`` architecture (Llama, Mistral, SmolLM), ``qwen2``, ``qwen3``,
``phi3`` and ``gemma3``, in any tensor type the ``gguf`` package can dequantize (F32,
F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ...). What llama.cpp's converter changed
is undone here: a Llama's Q and K rows permuted for its rotary layout; Phi-3's fused
``attn_qkv`` and gate/up (``ffn_up``) split back into their parts (which the model
fuses again); Gemma 3's norms stored as 1 + weight. Hyperparameters llama.cpp does
not store are set as llama.cpp sets them (Gemma 3: every sixth layer global unless
the file says otherwise, the sliding layers' rotary base 10000, the query scale).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tqdm import tqdm

from carpool.models.gguf_blocks import to_packed
from carpool.models.packed_linear import PackedWeight

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms a layer (llama.cpp's ffn_norm is its pre-feedforward one).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# A fused tensor of llama.cpp's -> its parts, in row order (Phi-3's).
_FUSED = {
    ("phi3", "attn_qkv"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("phi3", "ffn_up"): ("mlp.gate_proj", "mlp.up_proj"),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFCheckpoint:
    """A GGUF file's metadata, translated config and tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = GGUFReader(str(path))
        self.arch = str(self.field("general.architecture"))
        if self.arch not in _ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {self.arch!r} is not supported "
                f"({', '.join(_ARCHITECTURES)})"
            )

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            return field.contents()
        return field.contents()

    def hf_config(self) -> dict[str, Any]:
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        tokens = self.field("tokenizer.ggml.tokens") or []
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[a]],
            "model_type": a,
            "vocab_size": int(self.field(f"{a}.vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(
                self.field(
                    f"{a}.attention.key_length",
                    self.field(f"{a}.rope.dimension_count", hidden // heads),
                )
            ),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        rotary = self.field(f"{a}.rope.dimension_count")
        if rotary is not None and int(rotary) != config["head_dim"]:
            config["partial_rotary_factor"] = int(rotary) / config["head_dim"]
        if a == "gemma3":
            config.update(self._gemma3_config(config))
        elif a == "phi3":
            config.update(self._phi3_config())
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": float(self.field(f"{a}.rope.scaling.factor")),
            }
        elif scaling not in (None, "none") and "rope_scaling" not in config:
            raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported")
        return config

    def _gemma3_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's fields as transformers names them, where llama.cpp's loader
        (``src/models/gemma3.cpp``) reads them or supplies its defaults."""
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        window = int(self.field("gemma3.attention.sliding_window", 0) or 0)
        pattern = self.field("gemma3.attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern][:layers]
        else:  # llama.cpp's set_swa_pattern: the last layer of every n is global
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
        kinds = [
            "sliding_attention" if window and is_sliding else "full_attention"
            for is_sliding in sliding
        ]
        # llama.cpp scales queries by hidden / heads on the 62-layer (27B) model and
        # by the head size on the others (Gemma's own configuration).
        scalar = hidden // config["num_attention_heads"] if layers == 62 else config["head_dim"]
        cap = self.field("gemma3.final_logit_softcapping")
        # A chat turn ends with <end_of_turn> (Gemma's generation_config lists it
        # beside <eos>; llama.cpp ends generation on it by its text).
        tokens = list(self.field("tokenizer.ggml.tokens") or [])
        eos = [] if config["eos_token_id"] is None else [int(config["eos_token_id"])]
        if "<end_of_turn>" in tokens:
            eos.append(tokens.index("<end_of_turn>"))
        return {
            "eos_token_id": eos,
            "model_type": "gemma3_text",
            "sliding_window": window or None,
            "layer_types": kinds,
            "rope_local_base_freq": float(self.field("gemma3.rope.freq_base_swa", 10000.0)),
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": None if cap is None else float(cap),
            "hidden_activation": "gelu_pytorch_tanh",
        }

    def _phi3_config(self) -> dict[str, Any]:
        """Phi-3's window and, for its long-context models, longrope's factors
        (stored as tensors). llama.cpp ignores the window; transformers, and so
        carpool, attend within it."""
        window = int(self.field("phi3.attention.sliding_window", 0) or 0)
        extra: dict[str, Any] = {"sliding_window": window or None}
        factors = {t.name: t for t in self.reader.tensors if t.name.startswith("rope_factors_")}
        if factors:
            original = int(self.field("phi3.rope.scaling.original_context_length"))
            extra["original_max_position_embeddings"] = original
            extra["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": _floats(factors["rope_factors_long.weight"]),
                "short_factor": _floats(factors["rope_factors_short.weight"]),
            }
        return extra

    def tensors(
        self, progress: bool = True, skip: Collection[str] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every tensor not named in
        ``skip``, dequantized."""
        config = self.hf_config()
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        bar = tqdm(self.reader.tensors, desc=f"dequantizing {self.path.name}", disable=not progress)
        for tensor in bar:
            if tensor.name == "rope_freqs.weight":
                raise ValueError(f"{self.path}: rope_freqs scaling is not supported")
            if tensor.name.startswith("rope_factors_"):
                continue  # longrope's, read into the config
            parts = self.parts(tensor.name, config)
            if all(name in skip for name, _ in parts):
                continue
            shape = tuple(reversed([int(n) for n in tensor.shape]))
            array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            whole = torch.from_numpy(array.reshape(shape))
            for name, rows in parts:
                weight = whole if rows is None else whole[rows].contiguous()
                if self.arch == "llama" and name.endswith("q_proj.weight"):
                    weight = unpermute(weight, heads)
                elif self.arch == "llama" and name.endswith("k_proj.weight"):
                    weight = unpermute(weight, kv_heads)
                elif self.arch == "gemma3" and name.endswith("norm.weight"):
                    weight = weight - 1.0  # stored as 1 + weight (Gemma's norms scale by it)
                if name not in skip:
                    yield name, weight

    def parts(self, gguf_name: str, config: dict[str, Any]) -> list[tuple[str, slice | None]]:
        """The Hugging Face tensors a GGUF tensor holds, each with its rows (None:
        all of it): one, or a fused tensor's parts."""
        pieces = gguf_name.split(".")
        fused = _FUSED.get((self.arch, pieces[2])) if pieces[0] == "blk" else None
        if fused is None:
            return [(hf_name(gguf_name, self.arch), None)]
        layer, kind = pieces[1], pieces[-1]
        d = config["head_dim"]
        sizes = (
            [config["num_attention_heads"] * d] + [config["num_key_value_heads"] * d] * 2
            if len(fused) == 3
            else [config["intermediate_size"]] * 2
        )
        out: list[tuple[str, slice | None]] = []
        start = 0
        for part, size in zip(fused, sizes, strict=True):
            out.append((f"model.layers.{layer}.{part}.{kind}", slice(start, start + size)))
            start += size
        return out

    def packed_weights(self) -> dict[str, PackedWeight]:
        """Hugging Face name -> the file's blocks in a native layout
        (``carpool.models.gguf_blocks``), for every matrix of a type that has one
        (rows permuted back as ``tensors`` does); read without dequantizing."""
        config = self.hf_config()
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        packed = {}
        for tensor in self.reader.tensors:
            if len(tensor.shape) != 2:
                continue
            whole = to_packed(GGMLQuantizationType(tensor.tensor_type), np.asarray(tensor.data))
            if whole is None:
                continue
            for name, rows in self.parts(tensor.name, config):
                weight = whole
                if rows is not None:
                    weight = whole.permute_rows(torch.arange(whole.shape[0])[rows])
                if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    n = heads if name.endswith("q_proj.weight") else kv_heads
                    order = unpermute(torch.arange(weight.shape[0])[:, None], n)[:, 0]
                    weight = weight.permute_rows(order)
                packed[name] = weight
        return packed


def _floats(tensor: Any) -> list[float]:
    return [float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The Hugging Face name of an unfused GGUF tensor of ``arch``."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
    prefix, layer, part, kind = gguf_name.split(".")
    if prefix != "blk" or part not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the rotary halves of Q/K rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )
