"""The native decode-attention kernel (``kernels/paged_decode_attention.c``), built
by ``carpool.models.native``. The torch path in ``carpool.models.attention`` stays
for other devices and dtypes, and where no compiler is found.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from carpool.models.native import (
    KernelUnavailable,
    PathTaken,
    check_range,
    check_shape,
    check_tensors,
    load_library,
    torch_because,
)

# The cache dtypes the native kernels read (kernels/kv_cache.h): float32, and float16
# (half the bytes, rounded as torch rounds).
NATIVE_KV_DTYPES = (torch.float32, torch.float16)


class DecodeKernel:
    """Attention of one query token per sequence over its paged keys and values."""

    def __init__(self, function: Callable[..., int]) -> None:
        self._function = function

    def __call__(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> None:
        """``q``, ``out``: [S, H, D]; ``keys``, ``values``: [blocks, block_size, Hkv, D],
        float32 or float16; ``block_tables``: [S, max_blocks]; ``context_lens``: [S];
        ``window``: a sliding-window layer's (a row attends its last ``window``
        tokens). Writes ``out``."""
        if keys.dtype not in NATIVE_KV_DTYPES:
            raise ValueError(f"a KV cache of {keys.dtype}: the kernel reads float32 or float16")
        check_tensors(
            q=(q, torch.float32),
            keys=(keys, keys.dtype),
            values=(values, keys.dtype),
            out=(out, torch.float32),
            block_tables=(block_tables, torch.int64),
            context_lens=(context_lens, torch.int64),
        )
        if q.dim() != 3 or keys.dim() != 4:
            raise ValueError("q must be [S, H, D] and keys [blocks, block_size, Hkv, D]")
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = keys.shape
        max_blocks = block_tables.shape[1] if block_tables.dim() == 2 else 0
        check_shape("out", out, num_seqs, num_heads, head_dim)
        check_shape("keys", keys, num_blocks, block_size, num_kv_heads, head_dim)
        check_shape("values", values, num_blocks, block_size, num_kv_heads, head_dim)
        check_shape("block_tables", block_tables, num_seqs, max_blocks)
        check_shape("context_lens", context_lens, num_seqs)
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads")
        check_range("block_tables", block_tables, 0, num_blocks - 1)
        check_range("context_lens", context_lens, 1, max_blocks * block_size)
        if window is not None and window < 1:
            raise ValueError(f"a sliding window of {window} tokens")
        failed = self._function(
            q.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            max_blocks,
            window or 0,
            scale,
            int(keys.dtype == torch.float16),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("decode attention could not allocate its score buffer")


@functools.cache
def compile_decode_kernel() -> DecodeKernel:
    """The kernel, built once per process; raises KernelUnavailable."""
    return decode_kernel_in(load_library("paged_decode_attention"))


def decode_kernel_in(library: ctypes.CDLL) -> DecodeKernel:
    """The kernel of a loaded ``paged_decode_attention`` library."""
    function = library.paged_decode_attention
    function.restype = ctypes.c_int
    pointers, sizes = [ctypes.c_void_p] * 6, [ctypes.c_int64] * 7
    function.argtypes = [*pointers, *sizes, ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    return DecodeKernel(function)


def select_decode_kernel(
    choice: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
) -> tuple[DecodeKernel | None, PathTaken]:
    """The kernel ``choice`` (auto, native or torch) asks for (None: the torch path)
    and the path taken, for a model of ``dtype`` whose KV cache is ``kv_dtype`` (None:
    ``dtype``). ``native`` raises ValueError where the kernel cannot run; ``auto``
    falls back to torch and logs why."""
    part = "decode attention"
    if choice == "torch":
        return None, PathTaken(part, False, "attention_kernel is torch")
    unavailable = False
    kv_dtype = kv_dtype or dtype
    if device.type != "cpu":
        why = f"it runs on the CPU and the model is on {device}"
    elif dtype != torch.float32:
        why = f"it takes float32 and the model is {dtype}"
    elif kv_dtype not in NATIVE_KV_DTYPES:
        why = f"it reads a float32 or float16 KV cache, not {kv_dtype}"
    else:
        try:
            return compile_decode_kernel(), PathTaken(part, True, "paged_decode_attention")
        except KernelUnavailable as exc:
            why, unavailable = str(exc), True
    if choice == "native":
        raise ValueError(f"attention_kernel native cannot be used: {why}")
    return None, torch_because(part, f"the native kernel cannot be used: {why}", unavailable)
