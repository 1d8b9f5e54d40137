"""The encoder's self-attention over a ragged batch in one native call
(``kernels/ragged_attention.c``), built by ``carpool.models.native``. Without it
(another device or dtype, no compiler) the encoder attends one sequence at a time
in torch."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from carpool.models.native import (
    KernelUnavailable,
    PathTaken,
    check_tensors,
    load_library,
    torch_because,
)


class RaggedAttentionKernel:
    """Each sequence's tokens attend to all tokens of that sequence (no mask)."""

    def __init__(self, function: Callable[..., int]) -> None:
        self._function = function

    def __call__(
        self, qkv: torch.Tensor, offsets: torch.Tensor, num_heads: int, scale: float
    ) -> torch.Tensor:
        """``qkv``: [tokens, 3 * num_heads * head_dim] (q, k, v per token);
        ``offsets``: [sequences + 1], where each sequence starts. Returns [tokens,
        num_heads * head_dim]."""
        qkv = qkv.contiguous()
        check_tensors(qkv=(qkv, torch.float32), offsets=(offsets, torch.int64))
        tokens, width = qkv.shape
        if num_heads < 1 or width % (3 * num_heads):
            raise ValueError(f"a row of {width} is not q, k and v of {num_heads} heads")
        head_dim = width // (3 * num_heads)
        if offsets.dim() != 1 or len(offsets) < 2 or int(offsets[0]) != 0:
            raise ValueError("offsets must be [sequences + 1], starting at 0")
        if int(offsets[-1]) != tokens or bool((offsets.diff() < 0).any()):
            raise ValueError(f"offsets must rise from 0 to the {tokens} tokens")
        out = torch.empty(tokens, num_heads * head_dim, dtype=torch.float32)
        failed = self._function(
            qkv.data_ptr(),
            offsets.data_ptr(),
            out.data_ptr(),
            offsets.shape[0] - 1,
            num_heads,
            head_dim,
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("ragged attention could not allocate its score buffer")
        return out


@functools.cache
def compile_ragged_kernel() -> RaggedAttentionKernel:
    """The kernel, built once per process; raises KernelUnavailable."""
    function = load_library("ragged_attention").ragged_attention
    function.restype = ctypes.c_int
    function.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
    )
    return RaggedAttentionKernel(function)


def select_ragged_kernel(
    device: torch.device, dtype: torch.dtype
) -> tuple[RaggedAttentionKernel | None, PathTaken]:
    """The kernel where it can run (CPU, float32, a C compiler), else None (torch);
    and the path taken."""
    part = "encoder attention"
    if device.type != "cpu" or dtype != torch.float32:
        return None, torch_because(
            part, f"the kernel takes float32 on the CPU, not {dtype} on {device}", False
        )
    try:
        return compile_ragged_kernel(), PathTaken(part, True, "ragged_attention")
    except KernelUnavailable as exc:
        return None, torch_because(part, str(exc), True)
