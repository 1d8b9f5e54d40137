"""Paged attention on the GPU: Triton kernels that read each sequence's KV blocks in
place, and the one-kernel write of a step's keys and values into the cache (with the
rotary embedding of queries and keys in the same kernel, ``rotary_store``).

The cache of one layer is [2, num_blocks, block_size, kv_heads, head_dim] (keys,
then values), as on the CPU path (``carpool.models.attention``). A step's query rows
are grouped by sequence: sequence s owns rows ``query_start[s] .. query_start[s+1]``,
the last of the ``seq_lens[s]`` tokens of its context (the ones before are in the
cache already: prefix-cached blocks, earlier chunks). Row i of those attends the
context's first ``seq_lens[s] - n + i + 1`` tokens (causal), where n is the
sequence's row count. Grouped-query attention packs a KV head's query heads into
one tile, so each key block is read once per KV head.

Two specialisations of one kernel: decode (one row per sequence, one program per
sequence and KV head; a sequence with ``seq_lens`` 0 is padding and writes zeros,
which is what CUDA-graph replay at a bucket's size needs) and prefill (tiles of
``BLOCK_Q`` rows of one sequence, listed by the host). fp32 uses IEEE dot products
(no TF32) so fp32 stays exact against transformers; bf16 and fp16 accumulate in
fp32. Import needs Triton; under ``TRITON_INTERPRET=1`` the kernels run on the CPU
(the tests do that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_store_kernel(  # type: ignore[no-untyped-def]
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_table,
    values_offset,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
):
    token = tl.program_id(0)
    half = HEAD_DIM // 2
    position = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_P)
    valid_j = j < half
    # Each angle once: both halves of a head turn by it.
    cos = tl.load(cos_ptr + position * stride_table + j, mask=valid_j, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_table + j, mask=valid_j, other=0.0).to(tl.float32)
    head = tl.arange(0, HEADS_P)
    row = qkv_ptr + token.to(tl.int64) * stride_qkv

    # Queries: rotated into q_out [T, HEADS, HEAD_DIM].
    mask = (head[:, None] < HEADS) & valid_j[None, :]
    at = head[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(row + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + at + half, mask=mask, other=0.0).to(tl.float32)
    out = q_out_ptr + token.to(tl.int64) * HEADS * HEAD_DIM + at
    dtype = q_out_ptr.dtype.element_ty
    tl.store(out, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        # Keys rotated, values as they are, into the cache at the token's slot.
        mask = (head[:, None] < KV_HEADS) & valid_j[None, :]
        at = head[:, None] * HEAD_DIM + j[None, :]
        keys = row + HEADS * HEAD_DIM + at
        x1 = tl.load(keys, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(keys + half, mask=mask, other=0.0).to(tl.float32)
        dest = cache_ptr + slot * KV_HEADS * HEAD_DIM + at
        dtype = cache_ptr.dtype.element_ty
        tl.store(dest, (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(dest + half, (x2 * cos + x1 * sin).to(dtype), mask=mask)
        values = keys + KV_HEADS * HEAD_DIM
        tl.store(dest + values_offset, tl.load(values, mask=mask), mask=mask)
        tl.store(dest + values_offset + half, tl.load(values + half, mask=mask), mask=mask)


def rotary_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Rotary embedding and the cache write in one kernel: ``qkv`` [T, (heads + 2 *
    kv_heads) * head_dim] (a row's queries, keys, values); keys are rotated and,
    with the values, stored at ``slots`` (negative: skipped); returns the rotated
    queries [T, heads, head_dim]. ``cos_table``/``sin_table`` [positions, head_dim / 2]
    hold the angles both halves of a head share (``carpool.models.rope``)."""
    tokens, width = qkv.shape
    kv_heads, head_dim = cache.shape[-2:]
    if width != (heads + 2 * kv_heads) * head_dim or qkv.stride(1) != 1 or head_dim % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not {heads} + 2 x {kv_heads} heads")
    if cos_table.shape != sin_table.shape or cos_table.shape[1] != head_dim // 2:
        raise ValueError(f"rotary tables {tuple(cos_table.shape)} for head_dim {head_dim}")
    if not (cos_table.is_contiguous() and sin_table.is_contiguous() and cache.is_contiguous()):
        raise ValueError("the rotary tables and the cache must be contiguous")
    if slots.shape != (tokens,) or positions.shape != (tokens,):
        raise ValueError(f"positions / slots do not match {tokens} tokens")
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _rotary_store_kernel[(tokens,)](
        qkv,
        positions,
        cos_table,
        sin_table,
        q,
        cache,
        slots,
        qkv.stride(0),
        cos_table.stride(0),
        cache[0].numel(),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(max(heads, kv_heads)),
        HALF_P=triton.next_power_of_2(head_dim // 2),
    )
    return q


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    values_offset,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < WIDTH
        k = tl.load(k_ptr + token * stride_k + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_v + offs, mask=mask)
        tl.store(cache_ptr + slot * WIDTH + offs, k, mask=mask)
        tl.store(cache_ptr + values_offset + slot * WIDTH + offs, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write token t's ``k[t]``, ``v[t]`` ([T, Hkv, D], each row contiguous) into
    ``cache`` at slot ``slots[t]`` (block * block_size + offset); a negative slot
    (padding) is skipped. One kernel for keys and values."""
    tokens, kv_heads, head_dim = k.shape
    width = kv_heads * head_dim
    for name, t in (("k", k), ("v", v)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} rows must be contiguous [Hkv, D], strides {t.stride()}")
    if cache.shape[-2:] != (kv_heads, head_dim) or not cache.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} does not hold [{kv_heads}, {head_dim}]")
    if slots.shape != (tokens,):
        raise ValueError(f"{len(slots)} slots for {tokens} tokens")
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k,
        v,
        cache,
        slots,
        k.stride(0),
        v.stride(0),
        cache[0].numel(),
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
    )


# Triton compiles a variant per integer argument's value class (1, a multiple of 16,
# other): the block tables' row stride changes from step to step, so it is not
# specialised (each new variant would cost a compile of about a second mid-run); nor
# is a layer's sliding window (one variant for windowed and global layers).
@triton.jit(do_not_specialize=["stride_table", "window"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    out_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    tile_end_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    values_offset,
    scale,
    window,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    DECODE: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tile
        first_row = 0
    else:
        seq = tl.load(tile_seq_ptr + tile)
        first_row = tl.load(tile_row_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    num_rows = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    # Keys past the tile's last row are masked for every row: stop before them
    # (the host works the bound out for prefill tiles).
    end = seq_len
    if not DECODE:
        end = tl.load(tile_end_ptr + tile)
    cached = seq_len - num_rows

    m = tl.arange(0, BLOCK_M)
    row = first_row + m // GROUP_P  # the query row within its sequence
    head = kv_head * GROUP + m % GROUP_P
    valid_m = (m % GROUP_P < GROUP) & (m // GROUP_P < BLOCK_Q) & (row < num_rows)
    d = tl.arange(0, HEAD_DIM_P)
    valid_d = d < HEAD_DIM
    q_rows = (q_start + row).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=valid_m[:, None] & valid_d[None, :],
        other=0.0,
    )
    position = cached + row  # each row's own position: it sees keys 0..position
    # ... and within a sliding window only keys past position - window: the tile's
    # first row needs none before its own position - window + 1.
    lowest = tl.maximum(cached + first_row - window + 1, 0)

    peak = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    start = lowest // BLOCK_N * BLOCK_N
    # A while loop, not range(): Triton's interpreter cannot take a loaded bound there.
    while start < end:
        key = start + n
        valid_n = key < end
        block = tl.load(table + key // PAGE, mask=valid_n, other=0).to(tl.int64)
        slot = block * PAGE + key % PAGE
        offset = (slot * KV_HEADS + kv_head) * HEAD_DIM
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = tl.load(cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:  # noqa: SIM108 (one dot call each: Triton compiles the branch taken)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        allowed = valid_n[None, :] & (key[None, :] <= position[:, None])
        allowed = allowed & (key[None, :] > position[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        new_peak = tl.maximum(peak, tl.max(s, 1))
        # A row that has seen no key yet keeps -inf: shift by 0 instead (no NaN).
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        p = tl.exp(s - shift[:, None])
        correction = tl.exp(peak - shift)
        total = total * correction + tl.sum(p, 1)
        v = tl.load(
            cache_ptr + values_offset + offset[:, None] + d[None, :], mask=kv_mask, other=0.0
        )
        if IEEE:
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        peak = new_peak
        start += BLOCK_N
    total = tl.where(total == 0.0, 1.0, total)
    result = acc / total[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=valid_m[:, None] & valid_d[None, :],
    )


# The window of a layer that has none: past any context (an int32 the kernel can
# subtract from a position without overflowing).
NO_WINDOW = 1 << 30


@dataclass(frozen=True)
class Tiles:
    """The prefill kernel's work list: tile i is ``BLOCK_Q`` rows of sequence
    ``seq[i]`` from its row ``row[i]``, attending keys before ``end[i]``."""

    seq: torch.Tensor  # [tiles] int32
    row: torch.Tensor  # [tiles] int32
    end: torch.Tensor  # [tiles] int32: the context its last row sees


def prefill_block_q(group: int) -> int:
    """Query rows per prefill tile: the tile holds rows x query heads of a KV head,
    64 in all."""
    return max(1, 64 // triton.next_power_of_2(group))


def tiles_for(
    rows_per_seq: list[int], seq_lens: list[int], block_q: int
) -> tuple[list[int], list[int], list[int]]:
    """The prefill tiles covering each sequence's rows: their sequences, first rows
    and key ends (``Tiles``' fields)."""
    seqs: list[int] = []
    firsts: list[int] = []
    ends: list[int] = []
    for s, (n, length) in enumerate(zip(rows_per_seq, seq_lens, strict=True)):
        for first in range(0, n, block_q):
            seqs.append(s)
            firsts.append(first)
            ends.append(min(length, length - n + first + block_q))
    return seqs, firsts, ends


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: Tiles | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [T, H, D] over ``cache`` (this step's keys and values
    already stored). ``block_tables`` [S, W] int32, ``query_start`` [S + 1] int32,
    ``seq_lens`` [S] int32. ``tiles`` None: decode, one row per sequence (T >= S).
    ``window``: a sliding-window layer's (each row attends its last ``window``
    positions). Returns ``out`` [T, H, D] (allocated if None)."""
    heads, head_dim = q.shape[1:]
    _, _, page, kv_heads, cache_dim = cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(cache.shape)}")
    if q.stride(2) != 1 or not cache.is_contiguous():
        raise ValueError("q's head dimension and the cache must be contiguous")
    sequences = block_tables.shape[0]
    for name, t in (("query_start", query_start), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
    if query_start.shape != (sequences + 1,) or seq_lens.shape != (sequences,):
        raise ValueError(f"query_start / seq_lens do not match {sequences} block tables")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} tokens")
    if out is None:
        out = torch.empty_like(q)
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    decode = tiles is None
    block_q = 1 if decode else prefill_block_q(group)
    block_m = max(16, block_q * group_p)
    if tiles is None:
        grid = (sequences, kv_heads)
        tile_seq = tile_row = tile_end = seq_lens  # unread when decoding
    else:
        grid = (len(tiles.seq), kv_heads)
        tile_seq, tile_row, tile_end = tiles.seq, tiles.row, tiles.end
    if grid[0] == 0:
        return out
    _paged_attention_kernel[grid](
        q,
        out,
        cache,
        block_tables,
        query_start,
        seq_lens,
        tile_seq,
        tile_row,
        tile_end,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        cache[0].numel(),
        scale,
        NO_WINDOW if window is None else window,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=64 if decode else 32,
        PAGE=page,
        DECODE=decode,
        IEEE=q.dtype == torch.float32,
    )
    return out


class RotaryTables(Protocol):
    """cos and sin of every position's angles (``carpool.models.rope``)."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor


@dataclass(frozen=True)
class PagedMetadata:
    """One step's attention on the GPU (``AttentionMetadata.device``): rows grouped by
    sequence as ``paged_attention`` takes them; ``tiles`` None for a decode step."""

    slot_mapping: torch.Tensor  # [T] int64; -1: a padding row, not stored
    block_tables: torch.Tensor  # [S, W] int32
    query_start: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    tiles: Tiles | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        store_kv(k, v, cache, self.slot_mapping)
        return self._attend(q, cache, scale, window)

    def attend_rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryTables,
        cache: torch.Tensor,
        heads: int,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        q = rotary_store(
            qkv, positions, rope.cos_table, rope.sin_table, cache, self.slot_mapping, heads
        )
        return self._attend(q, cache, scale, window)

    def _attend(
        self, q: torch.Tensor, cache: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return paged_attention(
            q,
            cache,
            self.block_tables,
            self.query_start,
            self.seq_lens,
            scale,
            self.tiles,
            out,
            window,
        )
