"""Attention over a paged KV cache for a flat batch of tokens (no padding across
requests in the linear layers).

A step's tokens are laid out with the single-token rows first (decodes, and any
one-token prompt chunk), then each multi-token chunk (a prompt being prefilled),
attended on its own with a causal mask offset by what its sequence already has in
the cache. The single-token rows are attended either by the native kernel
(``carpool.models.decode_kernel``: one call, keys and values read in place) or, on
torch, sorted by context length and attended in groups, one batched call per group
over the group's gathered blocks (grouping similar lengths keeps the padding, and
so the copying, small).

The cache of one layer is a tensor [2, num_blocks, block_size, kv_heads, head_dim]
(keys, then values); a token's slot is ``block * block_size + offset``.

A sliding-window layer (``window``) attends a query at position p to keys p - window
+ 1 ... p only; its masks are the step's narrowed, and the native kernel (and the
device's, ``carpool.models.triton_attention``) starts each row there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from carpool.models.decode_kernel import DecodeKernel
from carpool.models.rope import RotaryEmbedding


@dataclass(frozen=True)
class PrefillSegment:
    """One multi-token chunk: tokens [start, start + num_tokens) of the step, at
    positions num_cached... of its sequence."""

    start: int
    num_tokens: int
    num_cached: int
    block_ids: torch.Tensor
    mask: torch.Tensor | None  # [num_tokens, num_cached + num_tokens]; None: plain causal


@dataclass(frozen=True)
class SingleGroup:
    """Single-token rows [start, start + count) of the step, attended together."""

    start: int
    count: int
    block_tables: torch.Tensor  # [count, max_blocks], padded with block 0
    mask: torch.Tensor  # [count, 1, 1, max_blocks * block_size]


@dataclass(frozen=True)
class NativeDecode:
    """The step's rows as the native kernels attend them, each row alone off the
    cache: row r attends the first ``context_lens[r]`` tokens of the sequence whose
    block table is ``block_tables[row_seqs[r]]``. The single-token rows [0, count)
    come first, one sequence each, so theirs are ``block_tables[:count]``; the
    torch path attends only those natively, the fused stack every row."""

    count: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks], padded with block 0
    row_seqs: torch.Tensor  # [T]
    context_lens: torch.Tensor  # [T], each row's position + 1
    kernel: DecodeKernel


class DeviceAttention(Protocol):
    """A step's attention done another way (on the GPU: ``carpool.models.
    triton_attention``): stores the step's keys and values, returns the output."""

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def attend_rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        cache: torch.Tensor,
        heads: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """``attend`` with the rotary embedding applied first (fused there)."""
        ...


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each token attends to, for every layer.
    The single-token rows are in ``native`` or in ``singles``, never both; with
    ``device`` set, it does the whole step's attention and the rest is unused."""

    slot_mapping: torch.Tensor  # [T]
    singles: tuple[SingleGroup, ...]
    prefills: tuple[PrefillSegment, ...]
    native: NativeDecode | None = None
    device: DeviceAttention | None = None
    # A hybrid model's windowed layers' own: slots and tables in the pool of blocks
    # their caches hold (``HybridBlockManager``); None where every layer shares these.
    windowed: AttentionMetadata | None = None

    def for_layer(self, window: int | None) -> AttentionMetadata:
        """What a layer with ``window`` (None: it attends everything) reads."""
        if window is not None and self.windowed is not None:
            return self.windowed
        return self


def allocate_kv_cache(
    layer_blocks: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each layer's cache, zeroed, of ``layer_blocks[layer]`` blocks (a hybrid
    model's windowed layers have a pool of their own)."""
    return [
        torch.zeros((2, n, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        for n in layer_blocks
    ]


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``q``: [T, H, D]; ``k``, ``v``: [T, Hkv, D]. Stores k and v in ``cache``, then
    returns the attention output [T, H, D] (over the last ``window`` positions where
    one is given)."""
    meta = meta.for_layer(window)
    if meta.device is not None:
        return meta.device.attend(q, k, v, cache, scale, window)
    kv_heads, head_dim = cache.shape[-2:]
    keys, values = cache[0], cache[1]
    if cache.dtype != k.dtype:
        # Every row attends keys and values as the cache holds them, its own too (as
        # the native kernels, which read them back): rounded once, widened for SDPA.
        k, v = k.to(cache.dtype), v.to(cache.dtype)
    keys.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    values.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    k, v = k.to(q.dtype), v.to(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.native is not None and meta.native.count:
        n = meta.native
        queries = q[: n.count].contiguous()
        tables, lens = n.block_tables[: n.count], n.context_lens[: n.count]
        n.kernel(queries, keys, values, tables, lens, out[: n.count], scale, window)
    for group in meta.singles:
        b, rows = group.count, slice(group.start, group.start + group.count)
        kc = keys[group.block_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        vc = values[group.block_tables].view(b, -1, kv_heads, head_dim).transpose(1, 2)
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        attended = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2),
            kc,
            vc,
            attn_mask=_windowed_single(group.mask, window),
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended.squeeze(2)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.num_tokens)
        mask = _windowed_prefill(seg, window)
        if mask is None:
            kc, vc = k[rows], v[rows]
        else:
            context = seg.num_cached + seg.num_tokens
            kc = keys[seg.block_ids].view(-1, kv_heads, head_dim)[:context].to(q.dtype)
            vc = values[seg.block_ids].view(-1, kv_heads, head_dim)[:context].to(q.dtype)
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            kc.transpose(0, 1).unsqueeze(0),
            vc.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out


def rotary_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    heads: tuple[int, int, int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``paged_attention`` of a fused projection ``qkv`` [T, (H + 2 Hkv) * D] whose
    queries and keys take the rotary embedding first; ``heads`` is (H, Hkv, D).
    Returns [T, H, D]."""
    h, hkv, d = heads
    meta = meta.for_layer(window)
    if meta.device is not None:
        return meta.device.attend_rotary(qkv, positions, rope, cache, h, scale, window)
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = rope(q.view(t, h, d), k.view(t, hkv, d), positions)
    return paged_attention(q, k, v.view(t, hkv, d), cache, meta, scale, window)


def _windowed_single(mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """A group's mask [count, 1, 1, keys] (each row's first len keys) keeping each
    row's last ``window`` keys only."""
    if window is None or mask.shape[-1] <= window:
        return mask
    lens = mask.sum(dim=-1, keepdim=True)
    keys = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (keys >= lens - window)


def _windowed_prefill(seg: PrefillSegment, window: int | None) -> torch.Tensor | None:
    """The chunk's mask (None: plain causal over the chunk alone), narrowed to
    ``window`` where the chunk reaches past it."""
    if window is None or seg.num_cached + seg.num_tokens <= window:
        return seg.mask
    device = seg.block_ids.device
    queries = torch.arange(seg.num_cached, seg.num_cached + seg.num_tokens, device=device)
    keys = torch.arange(seg.num_cached + seg.num_tokens, device=device)  # no mask: none cached
    causal = keys[None, :] <= queries[:, None] if seg.mask is None else seg.mask
    return causal & (keys[None, :] > queries[:, None] - window)
