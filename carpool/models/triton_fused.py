"""Element-wise work of a decoder layer fused into single Triton kernels for the GPU,
where a decode step's time is mostly its kernel count: the residual add with the
RMSNorm after it, and SwiGLU's SiLU with its product. Both compute in float32 and
round once to the tensors' dtype. ``carpool.models.llama`` calls them for CUDA
tensors; on the CPU it runs the same arithmetic in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    width,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * width + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = sum_ptr.dtype.element_ty
    # The sum is rounded to the model's dtype before the norm reads it, as the
    # unfused layer does.
    summed = (x + r).to(dtype)
    tl.store(sum_ptr + row * width + offs, summed, mask=mask)
    s = summed.to(tl.float32)
    rms = tl.rsqrt(tl.sum(s * s, axis=0) / width + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + offs, (s * rms * w).to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for [T, width] tensors."""
    if x.shape != residual.shape or x.dim() != 2 or weight.shape != (x.shape[1],):
        shapes = [tuple(t.shape) for t in (x, residual, weight)]
        raise ValueError(f"x, residual and weight of shapes {shapes} do not fit")
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x,
            residual,
            weight,
            out,
            summed,
            x.shape[1],
            eps,
            BLOCK=triton.next_power_of_2(x.shape[1]),
        )
    return out, summed


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(x_ptr + row * 2 * width + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + offs, mask=mask, other=0.0).to(tl.float32)
    silu = gate * tl.sigmoid(gate)
    tl.store(out_ptr + row * width + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(first half of each row) * second half: [T, 2 * width] -> [T, width]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x {tuple(x.shape)} is not [T, 2 * width]")
    x = x.contiguous()
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(width, block))](x, out, width, BLOCK=block)
    return out
