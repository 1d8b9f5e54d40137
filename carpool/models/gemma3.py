"""Gemma 3 (text, ``Gemma3ForCausalLM``) over a flat batch of tokens.

What differs from the Llama family (``carpool.models.llama``, whose projections,
attention and weight loading it shares): RMSNorms that scale by ``1 + weight`` in
float32; embeddings scaled by sqrt(hidden size); a norm after attention and one
before and one after the MLP; q/k norms; attention scaled by
``query_pre_attn_scalar ** -0.5``; GELU (tanh) gating; sliding layers and global
layers with rotary settings of their own, the sliding ones attending their window
only; optional tanh soft-capping of the logits. On a GGUF file's blocks its steps
run on the fused native stack as the Llama family's do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.attention import AttentionMetadata
from carpool.models.decoder_config import DecoderConfig
from carpool.models.llama import LlamaAttention, LlamaForCausalLM
from carpool.models.llama_stack import LayerWeights, LlamaStack, StackShape
from carpool.models.packed_linear import Embedding, Linear
from carpool.models.rope import RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__(cfg, rope, window)
        self.q_norm = GemmaRMSNorm(self.d, cfg.norm_eps)  # type: ignore[assignment]
        self.k_norm = GemmaRMSNorm(self.d, cfg.norm_eps)  # type: ignore[assignment]
        self.scale = cfg.attention_scale or self.d**-0.5


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig, rope: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Gemma3Attention(cfg, rope, window)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Hidden states for a step's tokens, and logits for the rows that sample;
    Hugging Face's tensor names are loaded as the Llama family's are."""

    _stacked: ClassVar[dict[str, tuple[str, int]]] = LlamaForCausalLM._stacked

    def __init__(self, cfg: DecoderConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        full = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        local = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.local_rope_theta,
            cfg.local_rope_scaling,
        )
        self.full_rope, self.local_rope = full, local
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma3Layer(cfg, full if w is None else local, w) for w in cfg.layer_windows()]
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)  # type: ignore[assignment]
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.stack = None
        self.stack_unused_because = "the model keeps no quantized blocks"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * _held_as(
            self.embed_scale, self.embed_tokens.weight.dtype
        )
        if self.stack is not None and LlamaStack.applies(x, meta):
            return self.stack(x, positions, caches, meta)  # the final norm included
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def stack_weights(self) -> list[LayerWeights]:
        """Each layer's weights for the fused stack, every norm's ``1 + weight``
        summed here (the stack multiplies by a norm's weight as given)."""
        layers = [cast(Gemma3Layer, layer) for layer in self.layers]
        return [
            LayerWeights(
                input_norm=_one_plus(layer.input_layernorm),
                post_norm=_one_plus(layer.pre_feedforward_layernorm),
                qkv=layer.self_attn.qkv_proj,
                o=layer.self_attn.o_proj,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                q_norm=_one_plus(cast(GemmaRMSNorm, layer.self_attn.q_norm)),
                k_norm=_one_plus(cast(GemmaRMSNorm, layer.self_attn.k_norm)),
                attn_out_norm=_one_plus(layer.post_attention_layernorm),
                mlp_out_norm=_one_plus(layer.post_feedforward_layernorm),
                window=layer.self_attn.window,
                local_rope=layer.self_attn.rope is self.local_rope,
            )
            for layer in layers
        ]

    def stack_shape(self) -> StackShape:
        return dataclasses.replace(
            super().stack_shape(),
            rope=self.full_rope,
            local_rope=self.local_rope,
            gelu=True,
            final_norm=_one_plus(cast(GemmaRMSNorm, self.norm)),
        )


def _one_plus(norm: GemmaRMSNorm) -> torch.Tensor:
    return (1.0 + norm.weight.detach().float()).contiguous()


@functools.cache
def _held_as(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype``, as a Python number: the embedding scale is
    multiplied in the weights' dtype (as transformers does), and a number, unlike a
    tensor made here and copied to the device, may be captured in a CUDA graph."""
    return float(torch.tensor(value, dtype=dtype))
