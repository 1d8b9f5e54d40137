"""Reading a GGUF file as a Hugging Face checkpoint: a ``config.json``-shaped dict
and Hugging Face-named float tensors, dequantized with the ``gguf`` package.

Supported: the ``llama`` architecture (Llama, Mistral, SmolLM), ``qwen2`` and ``qwen3``, in
any tensor type the ``gguf`` package can dequantize (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, the K-quants, ...). llama.cpp stores a Llama's Q and K rows permuted for its
rotary layout; they are permuted back here.
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
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling == "linear":
            config["rope_scaling"] = {
                "rope_type": "linear",
                "factor": float(self.field(f"{a}.rope.scaling.factor")),
            }
        elif scaling not in (None, "none"):
            raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported")
        return config

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
            name = hf_name(tensor.name)
            if name in skip:
                continue
            shape = tuple(reversed([int(n) for n in tensor.shape]))
            array = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            weight = torch.from_numpy(array.reshape(shape))
            if self.arch == "llama" and name.endswith("q_proj.weight"):
                weight = unpermute(weight, heads)
            elif self.arch == "llama" and name.endswith("k_proj.weight"):
                weight = unpermute(weight, kv_heads)
            yield name, weight

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
            weight = to_packed(GGMLQuantizationType(tensor.tensor_type), np.asarray(tensor.data))
            if weight is None:
                continue
            name = hf_name(tensor.name)
            if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n = heads if name.endswith("q_proj.weight") else kv_heads
                order = unpermute(torch.arange(weight.shape[0])[:, None], n)[:, 0]
                weight = weight.permute_rows(order)
            packed[name] = weight
        return packed


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, layer, part, kind = gguf_name.split(".")
    if prefix != "blk" or part not in _LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the rotary halves of Q/K rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )
