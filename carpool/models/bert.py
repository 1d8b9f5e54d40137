"""A BERT encoder over a flat batch of tokens.

Input is ragged: every sequence's tokens concatenated, with ``cu_seqlens`` giving
the offsets. The linear layers and norms, which carry nearly all the work, run on
the flat ``[tokens, hidden]`` tensor; attention runs per sequence. Nothing is
padded, so a batch costs the sum of its lengths.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.ragged_attention import RaggedAttentionKernel


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` that the encoder uses."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> BertConfig:
        if data.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        if data.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {data.get('hidden_act')!r}")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


class Ragged:
    """Where each sequence lies in a flat token batch."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.sizes = lengths
        self.lengths = torch.tensor(lengths, device=device)
        self.count = len(lengths)
        self.offsets = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        self.seq_index = torch.repeat_interleave(
            torch.arange(self.count, device=device), self.lengths
        )


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = h // self.heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.up = nn.Linear(h, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(
        self, x: torch.Tensor, ragged: Ragged, kernel: RaggedAttentionKernel | None = None
    ) -> torch.Tensor:
        tokens, hidden = x.shape
        fused = self.qkv(x)
        if kernel is not None:
            attn = kernel(fused, ragged.offsets, self.heads, self.head_dim**-0.5)
        else:
            # One sequence at a time: measured faster on CPU than padding the batch
            # for one masked call (no wasted work on pad positions).
            qkv = fused.view(tokens, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)
            per_seq = [
                F.scaled_dot_product_attention(q, k, v)
                for q, k, v in zip(*(p.split(ragged.sizes, dim=1) for p in qkv), strict=True)
            ]
            attn = torch.cat(per_seq, dim=1).transpose(0, 1).reshape(tokens, hidden)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.down(F.gelu(self.up(x), approximate=self.approximate)))


class BertEncoder(nn.Module):
    """BERT's embeddings and encoder stack; returns the last hidden state per token."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, h)
        self.position = nn.Embedding(config.max_position_embeddings, h)
        self.token_type = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        # Attention in one native call per layer where it can run; None: torch.
        self.attention_kernel: RaggedAttentionKernel | None = None

    def forward(self, input_ids: torch.Tensor, ragged: Ragged) -> torch.Tensor:
        x = self.word(input_ids) + self.position(ragged.positions) + self.token_type.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, ragged, self.attention_kernel)
        return x

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face ``BertModel`` state dict (with or without ``bert.``)."""
        tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
        own: dict[str, torch.Tensor] = {
            "word.weight": tensors["embeddings.word_embeddings.weight"],
            "position.weight": tensors["embeddings.position_embeddings.weight"],
            "token_type.weight": tensors["embeddings.token_type_embeddings.weight"],
            "embed_norm.weight": tensors["embeddings.LayerNorm.weight"],
            "embed_norm.bias": tensors["embeddings.LayerNorm.bias"],
        }
        for i in range(self.config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention.self."
            for kind in ("weight", "bias"):
                own[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [tensors[f"{a}{n}.{kind}"] for n in ("query", "key", "value")]
                )
                own[f"layers.{i}.attn_out.{kind}"] = tensors[p + f"attention.output.dense.{kind}"]
                own[f"layers.{i}.attn_norm.{kind}"] = tensors[
                    p + f"attention.output.LayerNorm.{kind}"
                ]
                own[f"layers.{i}.up.{kind}"] = tensors[p + f"intermediate.dense.{kind}"]
                own[f"layers.{i}.down.{kind}"] = tensors[p + f"output.dense.{kind}"]
                own[f"layers.{i}.out_norm.{kind}"] = tensors[p + f"output.LayerNorm.{kind}"]
        self.load_state_dict(own, strict=True)


def mean_pool(hidden: torch.Tensor, ragged: Ragged, normalize: bool) -> torch.Tensor:
    """Mean of each sequence's token states, optionally L2-normalised: [batch, hidden]."""
    sums = hidden.new_zeros((ragged.count, hidden.shape[1])).index_add_(0, ragged.seq_index, hidden)
    means = sums / ragged.lengths[:, None].to(hidden.dtype)
    return F.normalize(means, p=2, dim=1) if normalize else means
