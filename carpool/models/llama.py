"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a flat batch of tokens.

RMSNorm, rotary embeddings, grouped-query attention over the paged KV cache,
SwiGLU, tied or untied embeddings; Qwen3's RMSNorm over each head's query and key
before the rotary embedding. Q/K/V and gate/up projections are fused into
one matrix each (fewer, larger matmuls); ``load_weights`` takes Hugging Face's
tensor names and stacks them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, MutableMapping
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from carpool.models.attention import AttentionMetadata, rotary_attention
from carpool.models.decoder_config import DecoderConfig
from carpool.models.llama_stack import LayerWeights, LlamaStack, StackShape
from carpool.models.native import KernelUnavailable
from carpool.models.packed_linear import (
    Embedding,
    Linear,
    PackedWeight,
    QuantizedLinearKernel,
    drop_float,
)
from carpool.models.rope import RotaryEmbedding

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm of ``x + residual``, and the sum (the next residual): one kernel
        on a GPU (``carpool.models.triton_fused``)."""
        if x.is_cuda:
            from carpool.models.triton_fused import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self(summed), summed


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, rope: RotaryEmbedding, window: int | None = None
    ) -> None:
        super().__init__()
        self.window = window
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.rope = rope
        self.scale = self.d**-0.5
        self.q_norm = RMSNorm(self.d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            qkv = self._norm_heads(qkv, self.q_norm, self.k_norm)
        heads = (self.h, self.hkv, self.d)
        out = rotary_attention(
            qkv, positions, self.rope, cache, meta, heads, self.scale, self.window
        )
        return self.o_proj(out.view(x.shape[0], self.h * self.d))

    def _norm_heads(self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm) -> torch.Tensor:
        """``qkv`` with each query and key head normalised (Qwen3's q/k norm)."""
        t, h, hkv, d = qkv.shape[0], self.h, self.hkv, self.d
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q = q_norm(q.reshape(t, h, d)).reshape(t, h * d)
        k = k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        return torch.cat([q, k, v], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:  # one kernel instead of two
            from carpool.models.triton_fused import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, rope: RotaryEmbedding, window: int | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg, rope, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output before its residual is added, and that residual (the
        stream so far): the next norm adds them, fused where it can (vLLM's way).
        ``residual`` None: ``x`` is the embedding."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Hidden states for a step's tokens, and logits for the rows that sample."""

    # Hugging Face name fragment -> (our fused parameter, which slice).
    _stacked: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaLayer(cfg, rope, w) for w in cfg.layer_windows()])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.stack: LlamaStack | None = None
        self.stack_unused_because = "the model keeps no quantized blocks"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.stack is not None and LlamaStack.applies(x, meta):
            return self.stack(x, positions, caches, meta)  # the final norm included
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = layer(x, residual, positions, cache, meta)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def stack_weights(self) -> list[LayerWeights]:
        """Each decoder layer's weights, as the fused stack reads them."""
        layers = [cast(LlamaLayer, layer) for layer in self.layers]
        return [
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                qkv=layer.self_attn.qkv_proj,
                o=layer.self_attn.o_proj,
                gate_up=layer.mlp.gate_up_proj,
                down=layer.mlp.down_proj,
                q_norm=_weight_of(layer.self_attn.q_norm),
                k_norm=_weight_of(layer.self_attn.k_norm),
                window=layer.self_attn.window,
            )
            for layer in layers
        ]

    def stack_shape(self) -> StackShape:
        cfg = self.config
        attention = cast(LlamaLayer, self.layers[0]).self_attn
        return StackShape(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.norm_eps,
            attention.scale,
            attention.rope,
            self.norm.weight.detach(),
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], blocks_hold: Collection[str] = ()
    ) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Every
        parameter must be covered (tied heads excepted): by a tensor, or by the
        blocks of ``blocks_hold``'s names (``drop_float_where_blocks``)."""
        cfg = self.config
        if cfg.tie_word_embeddings:  # re-tie: moving off the meta device unties
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name in blocks_hold:
            target = self._target(hf_name)
            if target is not None:
                loaded.add(target[0] if target[1] is None else f"{target[0]}:{target[1]}")
        for hf_name, tensor in weights:
            target = self._target(hf_name)
            if target is None:
                continue
            name, index = target
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r}")
            if index is None:
                params[name].data.copy_(tensor)
                loaded.add(name)
                continue
            sizes = self._fused_sizes(name)
            start = sum(sizes[:index])
            params[name].data[start : start + sizes[index]].copy_(tensor)
            loaded.add(f"{name}:{index}")
        _check_complete(self, loaded)

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        """Our parameter for a Hugging Face tensor, and its slice of a fused one;
        None for a tensor not loaded (rotary tables, a tied head)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for part, (fused, index) in self._stacked.items():
            if f".{part}." in name:
                return name.replace(part, fused), index
        return name, None

    def _fused_sizes(self, name: str) -> list[int]:
        cfg = self.config
        if "qkv_proj" in name:
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2

    def _block_sources(self) -> Iterator[tuple[nn.Module, list[str]]]:
        """Each layer that can run on a GGUF file's blocks, with the Hugging Face
        tensors its weight is made of."""
        sources: dict[str, list[str]] = {}  # fused parameter -> its parts, in order
        for part, (fused, _) in sorted(self._stacked.items(), key=lambda item: item[1]):
            sources.setdefault(fused, []).append(part)
        yield self.embed_tokens, ["model.embed_tokens.weight"]
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            if name == "lm_head":
                tied = self.config.tie_word_embeddings
                yield module, ["model.embed_tokens.weight" if tied else "lm_head.weight"]
            else:
                prefix, part = f"model.{name}".rsplit(".", 1)
                yield module, [f"{prefix}.{p}.weight" for p in sources.get(part, [part])]

    def drop_float_where_blocks(self, packed: Mapping[str, PackedWeight]) -> set[str]:
        """Before loading: give every layer whose weight ``packed`` holds whole an
        empty float32 weight (a GGUF model then takes about its file's memory, not
        float32's 4-8x). Returns the Hugging Face names the blocks hold."""
        held: set[str] = set()
        for module, hf in self._block_sources():
            if all(h in packed for h in hf):
                drop_float(module)  # type: ignore[arg-type]
                held.update(hf)
        return held

    def attach_packed(
        self, packed: MutableMapping[str, PackedWeight], kernel: QuantizedLinearKernel | None
    ) -> int:
        """Give each linear layer whose Hugging Face weights are all in ``packed``
        its blocks (a fused projection of mixed layouts as Q8_0 or Q8_16,
        ``PackedWeight.stack``, and interleaved part by part where the kernel
        interleaves, ``Linear.attach_parts``); None detaches.
        The entries of ``packed`` are taken (removed from it) as they are used, each
        read once (a ``BlocksFile`` reads it then), so a fused projection's parts are
        freed once stacked.
        An embedding whose float32 table was dropped looks its rows up in the
        blocks. Returns how many linear layers got them. When every decoder layer
        has them, steps run on the fused stack (``carpool.models.llama_stack``)
        where attention is native."""
        attached = 0
        sources = list(self._block_sources())
        uses = Counter(h for _, hf in sources for h in hf)
        taken: dict[str, PackedWeight] = {}  # read, and still to be used (a tied head)

        def take(name: str) -> PackedWeight:
            if name not in taken:
                taken[name] = packed[name]
                del packed[name]
            return taken[name]

        for module, hf in sources:
            parts = [take(h) for h in hf if h in packed or h in taken]
            usable = kernel is not None and len(parts) == len(hf)
            if isinstance(module, Embedding):
                kept = usable and not module.weight.numel()
                module.packed = parts[0].lean() if kept else None
                module.kernel = kernel
                module.interleaved = None
            elif usable:
                module.attach_parts(parts, kernel)  # type: ignore[operator]
                attached += 1
            else:
                module.attach(None, None)  # type: ignore[operator]
            for h in hf:  # taken: a fused part's own blocks can go once stacked
                uses[h] -= 1
                if not uses[h]:
                    taken.pop(h, None)
        if self.config.tie_word_embeddings:
            self.embed_tokens.share(self.lm_head)  # one copy of the table, not two
        self.stack = None
        self.stack_unused_because = "not every linear layer has its blocks"
        weights = self.stack_weights()
        if kernel is not None and LlamaStack.usable(weights):
            try:
                self.stack = LlamaStack(weights, self.stack_shape(), kernel.int8_dots)
            except KernelUnavailable as exc:
                self.stack_unused_because = str(exc)
                log.warning("steps run layer by layer: no fused stack (%s)", exc)
        return attached


def _weight_of(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _check_complete(model: nn.Module, loaded: set[str]) -> None:
    missing = []
    for name, _ in model.named_parameters():
        if name in loaded:
            continue
        fused = [key for key in loaded if key.startswith(f"{name}:")]
        expected = 3 if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias") else 2
        if not fused or len(fused) != expected:
            missing.append(name)
    if missing:
        raise ValueError(f"weights missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")
