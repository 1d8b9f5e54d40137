"""GPT-2 over a flat batch of tokens: learned positions, LayerNorm, fused QKV,
GELU (tanh), tied embeddings, attention over the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.attention import AttentionMetadata, paged_attention
from carpool.models.decoder_config import DecoderConfig

# Hugging Face's GPT-2 stores these as Conv1D, [in, out]: transposed for nn.Linear.
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.h, self.d = cfg.num_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.scale = self.d**-0.5

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (part.view(t, self.h, self.d) for part in self.c_attn(x).chunk(3, dim=-1))
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.c_proj(out.view(t, self.h * self.d))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList([GPT2Block(cfg) for _ in range(cfg.num_layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, cache in zip(self.h, caches, strict=True):
            x = block(x, cache, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.wte.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith(".attn.bias") or "masked_bias" in name:
                continue  # tied head; old checkpoints' causal-mask buffers
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r}")
            params[name].data.copy_(tensor.t() if name.endswith(_CONV1D) else tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"weights missing for {missing[:5]}")
