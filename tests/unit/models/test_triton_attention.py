"""The GPU's paged attention kernels against torch's attention over the same blocks,
gathered: decode rows, prompt chunks after prefix-cached blocks, grouped-query
heads, padding rows; the fused rotary embedding and the cache write. On a GPU the
compiled kernels run (float32 exactly, bfloat16 within its rounding); without one,
Triton's interpreter runs them on the CPU (chosen in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
triton_attention = pytest.importorskip("carpool.models.triton_attention")

DEVICE = "cuda" if CUDA else "cpu"
PAGE = 16
DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 dots need a GPU")),
]


def reference(q, cache, tables, query_start, seq_lens):  # type: ignore[no-untyped-def]
    """Each sequence's rows attend its first seq_len - rows + i + 1 keys (causal)."""
    kv_heads, head_dim = cache.shape[-2:]
    out = torch.empty_like(q)
    for s, length in enumerate(seq_lens):
        a, b = query_start[s], query_start[s + 1]
        blocks = tables[s][: -(-length // PAGE)]
        k = cache[0][blocks].reshape(-1, kv_heads, head_dim)[:length]
        v = cache[1][blocks].reshape(-1, kv_heads, head_dim)[:length]
        keys = torch.arange(length, device=q.device)
        mask = keys[None, :] <= torch.arange(length - (b - a), length, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None].float(),
            k.transpose(0, 1)[None].float(),
            v.transpose(0, 1)[None].float(),
            attn_mask=mask,
            scale=head_dim**-0.5,
            enable_gqa=True,
        )
        out[a:b] = o[0].transpose(0, 1).to(q.dtype)
    return out


def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def run(heads: int, kv_heads: int, head_dim: int, rows: list[int], lens: list[int], dtype):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(sum(rows) + heads)
    blocks = 64
    cache = torch.randn(2, blocks, PAGE, kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    order = torch.randperm(blocks, generator=generator).tolist()
    tables = [order[i * 16 : (i + 1) * 16] for i in range(len(rows))]
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=generator).to(DEVICE, dtype)
    tiles = None
    if max(rows) > 1:
        group = heads // kv_heads
        seq, first, end = triton_attention.tiles_for(
            rows, lens, triton_attention.prefill_block_q(group)
        )
        tiles = triton_attention.Tiles(int32(seq), int32(first), int32(end))
    got = triton_attention.paged_attention(
        q, cache, int32(tables), int32(starts), int32(lens), head_dim**-0.5, tiles
    )
    return got.float(), reference(q, cache, tables, starts, lens).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 32)])
def test_decode_rows_match_torch(heads: int, kv_heads: int, head_dim: int, dtype) -> None:  # type: ignore[no-untyped-def]
    got, want = run(heads, kv_heads, head_dim, [1, 1, 1], [5, 37, 200], dtype)
    assert (got - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 16)])
def test_prompt_chunks_after_cached_blocks_match_torch(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype,  # type: ignore[no-untyped-def]
) -> None:
    # A chunk after 17 cached tokens, a fresh 70-token prompt, a decode row, and a
    # chunk of 130 rows after 100 cached (more rows than one tile).
    got, want = run(heads, kv_heads, head_dim, [20, 70, 1, 130], [37, 70, 5, 230], dtype)
    assert (got - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("rows", [[1, 1, 1], [20, 70, 1, 130]], ids=["decode", "chunks"])
def test_blocks_behind_a_window_count_for_nothing(rows: list[int]) -> None:
    """The engine releases the blocks behind a sliding window (their entries then
    name its null block, zeros) and hands them to other sequences: with those
    entries pointing at a block of other, huge values, each row's output is the same
    bits. The kernel's key tiles may start before the window and read such a block,
    masked: that must add exactly nothing."""
    heads, kv_heads, head_dim, window = 4, 2, 16, 24
    lens = [5, 37, 200] if len(rows) == 3 else [37, 70, 5, 230]
    generator = torch.Generator().manual_seed(7)
    cache = torch.randn(2, 65, PAGE, kv_heads, head_dim, generator=generator).to(DEVICE)
    cache[:, 64] = 1e4
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(rows))]
    starts = [0]
    for n in rows:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=generator).to(DEVICE)
    tiles = None
    if max(rows) > 1:
        block_q = triton_attention.prefill_block_q(heads // kv_heads)
        tiles = triton_attention.Tiles(
            *(int32(f) for f in triton_attention.tiles_for(rows, lens, block_q))
        )

    def attend(block_tables: list[list[int]]) -> torch.Tensor:
        return triton_attention.paged_attention(
            q,
            cache,
            int32(block_tables),
            int32(starts),
            int32(lens),
            0.25,
            tiles,
            window=window,
        )

    whole = attend(tables)
    released = [
        [64 if (b + 1) * PAGE <= length - n - window + 1 else block for b, block in enumerate(t)]
        for t, n, length in zip(tables, rows, lens, strict=True)
    ]
    assert released != tables, "some block lies behind a window"
    assert torch.equal(attend(released), whole)


def test_a_padding_sequence_attends_nothing_and_writes_zeros() -> None:
    cache = torch.randn(2, 4, PAGE, 2, 16, device=DEVICE)
    q = torch.randn(2, 4, 16, device=DEVICE)
    out = triton_attention.paged_attention(
        q, cache, int32([[1, 0], [0, 0]]), int32([0, 1, 2]), int32([9, 0]), 0.25
    )
    assert torch.isfinite(out).all() and bool((out[1] == 0).all())
    assert not bool((out[0] == 0).all())


def test_store_kv_writes_each_slot_and_skips_negative_ones() -> None:
    cache = torch.zeros(2, 4, PAGE, 2, 16, device=DEVICE)
    k = torch.randn(3, 2, 16, device=DEVICE)
    v = torch.randn(3, 2, 16, device=DEVICE)
    triton_attention.store_kv(k, v, cache, torch.tensor([5, -1, 63], device=DEVICE))
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 63], v[2])
    assert int((flat.abs().sum(dim=(2, 3)) > 0).sum()) == 4  # slots 5 and 63, keys and values


def test_rotary_store_matches_the_rope_module_and_fills_the_cache() -> None:
    from carpool.models.rope import RotaryEmbedding

    heads, kv_heads, head_dim, tokens = 6, 2, 32, 5
    rope = RotaryEmbedding(head_dim, 512, 10000.0, {}).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    positions = torch.tensor([0, 7, 100, 511, 3], device=DEVICE)
    slots = torch.tensor([0, 1, -1, 40, 17], device=DEVICE)
    cache = torch.zeros(2, 4, PAGE, kv_heads, head_dim, device=DEVICE)
    q = triton_attention.rotary_store(
        qkv, positions, rope.cos_table, rope.sin_table, cache, slots, heads
    )
    wq, wk, wv = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    want_q, want_k = rope(
        wq.reshape(tokens, heads, head_dim), wk.reshape(tokens, kv_heads, head_dim), positions
    )
    assert (q - want_q).abs().max() < 1e-5
    flat = cache.view(2, -1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert (flat[0, slot] - want_k[t]).abs().max() < 1e-5
            assert torch.equal(flat[1, slot], wv[t].reshape(kv_heads, head_dim))
    assert int((flat.abs().sum(dim=(2, 3)) > 0).sum()) == 8  # four slots, keys and values


def test_bad_shapes_are_refused_before_a_kernel_runs() -> None:
    cache = torch.zeros(2, 4, PAGE, 2, 16, device=DEVICE)
    q = torch.randn(2, 3, 16, device=DEVICE)  # 3 heads do not group over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        triton_attention.paged_attention(
            q, cache, int32([[0], [1]]), int32([0, 1, 2]), int32([1, 1]), 1.0
        )
    q = torch.randn(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        triton_attention.paged_attention(
            q, cache, int32([[0], [1]]), torch.tensor([0, 1, 2], device=DEVICE), int32([1, 1]), 1.0
        )
    with pytest.raises(ValueError, match="slots"):
        triton_attention.store_kv(
            torch.zeros(2, 2, 16, device=DEVICE),
            torch.zeros(2, 2, 16, device=DEVICE),
            cache,
            torch.tensor([0], device=DEVICE),
        )
