"""The native decode-attention kernel computes what the torch path computes, for
each sequence whatever else is in the batch; it is used only where it can run."""

from __future__ import annotations

import pytest
import torch

from carpool.config import ConfigError, EngineConfig
from carpool.models.attention import AttentionMetadata, NativeDecode, SingleGroup, paged_attention
from carpool.models.decode_kernel import (
    DecodeKernel,
    compile_decode_kernel,
    select_decode_kernel,
)
from carpool.models.native import KernelUnavailable, load_library


def paged_inputs(
    contexts: list[int],
    heads: int,
    kv_heads: int,
    block_size: int,
    seed: int = 0,
    head_dim: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A random cache with each sequence's blocks scattered over it, and the queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in contexts]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(order[used : used + n])
        used += n
    q = torch.randn(len(contexts), heads, head_dim, generator=gen)
    return cache, q, tables


def attend(
    cache: torch.Tensor,
    q: torch.Tensor,
    tables: list[list[int]],
    contexts: list[int],
    native: bool,
    kernel: DecodeKernel | None = None,
    window: int | None = None,
) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor(contexts)
    block_size = cache.shape[2]
    if native:
        meta = AttentionMetadata(
            torch.empty(0, dtype=torch.long),
            (),
            (),
            NativeDecode(
                len(contexts),
                padded,
                torch.arange(len(contexts)),
                lens,
                kernel or compile_decode_kernel(),
            ),
        )
    else:
        keys = torch.arange(width * block_size)
        mask = (keys[None, :] < lens[:, None])[:, None, None, :]
        group = SingleGroup(0, len(contexts), padded, mask)
        meta = AttentionMetadata(torch.empty(0, dtype=torch.long), (group,), ())
    empty = torch.empty(0, cache.shape[3], cache.shape[4])
    return paged_attention(q, empty, empty, cache, meta, scale=0.25, window=window)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "head_dim"),
    [(4, 4, 16, 16), (6, 2, 8, 16), (9, 3, 16, 64), (6, 3, 8, 12)],  # 12: the scalar path
)
def test_native_matches_torch(heads: int, kv_heads: int, block_size: int, head_dim: int) -> None:
    contexts = [1, 7, 16, 17, 40, 131]
    cache, q, tables = paged_inputs(contexts, heads, kv_heads, block_size, head_dim=head_dim)
    torch_out = attend(cache, q, tables, contexts, native=False)
    native_out = attend(cache, q, tables, contexts, native=True)
    torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 3, 12)])
def test_a_half_cache_is_read_as_the_floats_it_holds(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """A float16 cache gives the bits its values widened to float32 give (the vector
    path, and 12: the scalar one), within a window too; the torch path reads it alike."""
    contexts = [1, 7, 16, 17, 40, 131]
    cache, q, tables = paged_inputs(contexts, heads, kv_heads, 16, head_dim=head_dim)
    half = cache.half()
    for window in (None, 17):
        widened = attend(half.float(), q, tables, contexts, native=True, window=window)
        got = attend(half, q, tables, contexts, native=True, window=window)
        assert torch.equal(got, widened)
        torch_out = attend(half, q, tables, contexts, native=False, window=window)
        torch.testing.assert_close(got, torch_out, rtol=1e-5, atol=1e-5)
    # the rounding is there to see: a float32 cache of the same draws reads otherwise
    assert not torch.equal(attend(cache, q, tables, contexts, native=True), got)


@pytest.mark.parametrize("head_dim", [16, 12])  # 12: the scalar path
def test_a_sliding_window_starts_each_row_where_torch_does(head_dim: int) -> None:
    """Windows that start mid-block, on a block edge, and before the context (all of it)."""
    contexts = [1, 7, 16, 17, 40, 131]
    cache, q, tables = paged_inputs(contexts, 6, 2, 8, head_dim=head_dim)
    whole = attend(cache, q, tables, contexts, native=True)
    for window in (5, 8, 17):
        torch_out = attend(cache, q, tables, contexts, native=False, window=window)
        native_out = attend(cache, q, tables, contexts, native=True, window=window)
        torch.testing.assert_close(native_out, torch_out, rtol=1e-5, atol=1e-5)
        within = [i for i, c in enumerate(contexts) if c <= window]
        assert torch.equal(native_out[within], whole[within])
        past = [i for i, c in enumerate(contexts) if c > window]
        assert not torch.allclose(native_out[past], whole[past])


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch() -> None:
    contexts = [5, 64, 300, 33]
    cache, q, tables = paged_inputs(contexts, 6, 2, 16, seed=3)
    batched = attend(cache, q, tables, contexts, native=True)
    for i in range(len(contexts)):
        alone = attend(cache, q[i : i + 1], tables[i : i + 1], contexts[i : i + 1], native=True)
        assert torch.equal(alone[0], batched[i])


def laid_out(
    keys_values: list[torch.Tensor], block_size: int, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Each sequence's keys and values ([2, context, kv_heads, head_dim]) in a cache of
    ``block_size``, its blocks scattered; the cache and the block tables."""
    need = [-(-kv.shape[1] // block_size) for kv in keys_values]
    num_blocks = sum(need) + 1
    cache = torch.zeros(2, num_blocks, block_size, *keys_values[0].shape[2:])
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for kv, n in zip(keys_values, need, strict=True):
        table = order[used : used + n]
        used += n
        for t in range(kv.shape[1]):
            cache[:, table[t // block_size], t % block_size] = kv[:, t]
        tables.append(table)
    return cache, tables


def test_a_sequence_gets_the_same_bits_whatever_blocks_hold_it() -> None:
    """A score is summed the same way eight keys at a time as one at a time, and the
    values in token order, whatever runs the blocks cut the tokens into: blocks of 4
    score one key at a time, of 16 and 64 eight at a time; 300 keys pass a span."""
    contexts = [3, 29, 300]
    gen = torch.Generator().manual_seed(4)
    keys_values = [torch.randn(2, c, 3, 64, generator=gen) for c in contexts]
    q = torch.randn(len(contexts), 9, 64, generator=gen)
    results = []
    for block_size in (4, 16, 64):
        cache, tables = laid_out(keys_values, block_size, seed=block_size)
        results.append(attend(cache, q, tables, contexts, native=True))
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_the_kernel_refuses_tensors_it_cannot_read() -> None:
    kernel = compile_decode_kernel()
    cache = torch.zeros(2, 4, 16, 2, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="q must be a contiguous"):
        kernel(
            torch.zeros(1, 2, 16).half(),
            cache[0],
            cache[1],
            tables,
            lens,
            torch.zeros(1, 2, 16),
            1.0,
        )
    with pytest.raises(ValueError, match="block_tables"):
        kernel(
            torch.zeros(1, 2, 16),
            cache[0],
            cache[1],
            tables.int(),
            lens,
            torch.zeros(1, 2, 16),
            1.0,
        )


@pytest.mark.parametrize(
    ("tables", "lens", "out", "match"),
    [
        ([[4]], [1], (1, 2, 16), "block_tables holds 4..4"),  # past the 4 blocks
        ([[-1]], [1], (1, 2, 16), "block_tables holds -1"),
        ([[0]], [17], (1, 2, 16), "context_lens"),  # more than one block of 16 holds
        ([[0]], [0], (1, 2, 16), "context_lens"),
        ([[0], [1]], [1, 1], (1, 2, 16), "block_tables has shape"),  # a table too many
        ([[0]], [1], (1, 4, 16), "out has shape"),
    ],
)
def test_the_kernel_refuses_indices_and_shapes_that_point_outside(
    tables: list[list[int]], lens: list[int], out: tuple[int, ...], match: str
) -> None:
    cache = torch.zeros(2, 4, 16, 2, 16)
    with pytest.raises(ValueError, match=match):
        compile_decode_kernel()(
            torch.zeros(1, 2, 16),
            cache[0].contiguous(),
            cache[1].contiguous(),
            torch.tensor(tables),
            torch.tensor(lens),
            torch.zeros(out),
            1.0,
        )


def test_selection_follows_the_config_and_says_which_path() -> None:
    cpu = torch.device("cpu")
    kernel, path = select_decode_kernel("torch", cpu, torch.float32)
    assert kernel is None and not path.native and "torch" in str(path)
    kernel, path = select_decode_kernel("native", cpu, torch.float32)
    assert kernel is compile_decode_kernel() and path.native
    assert str(path) == "decode attention: native (paged_decode_attention)"
    kernel, path = select_decode_kernel("auto", cpu, torch.bfloat16)
    assert kernel is None and "float32" in path.detail
    with pytest.raises(ValueError, match="native cannot be used: it takes float32"):
        select_decode_kernel("native", cpu, torch.float16)
    with pytest.raises(ConfigError, match="attention_kernel must be auto, native or torch"):
        EngineConfig(attention_kernel="flash")


def test_a_cache_dtype_the_kernel_cannot_read_takes_the_torch_path() -> None:
    cpu = torch.device("cpu")
    kernel, path = select_decode_kernel("auto", cpu, torch.float32, torch.float16)
    assert kernel is compile_decode_kernel() and path.native
    kernel, path = select_decode_kernel("auto", cpu, torch.float32, torch.bfloat16)
    assert kernel is None and "float32 or float16 KV cache" in path.detail
    with pytest.raises(ValueError, match=r"not torch\.bfloat16"):
        select_decode_kernel("native", cpu, torch.float32, torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reads float32 or float16"):
        compile_decode_kernel()(
            torch.zeros(1, 2, 16),
            cache[0],
            cache[1],
            torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            torch.zeros(1, 2, 16),
            1.0,
        )


def test_without_a_compiler_auto_falls_back_with_a_warning_and_native_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("carpool.models.native.default_compiler", lambda: None)
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        load_library.__wrapped__("paged_decode_attention")
    monkeypatch.setattr("carpool.models.decode_kernel.compile_decode_kernel", _unavailable)
    cpu = torch.device("cpu")
    with caplog.at_level("INFO"):
        kernel, path = select_decode_kernel("auto", cpu, torch.float32)
    assert kernel is None and not path.native and "no C compiler" in path.detail
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    with pytest.raises(ValueError, match="native cannot be used: no C compiler"):
        select_decode_kernel("native", cpu, torch.float32)


def _unavailable() -> None:
    raise KernelUnavailable("no C compiler (cc or gcc) on PATH")
