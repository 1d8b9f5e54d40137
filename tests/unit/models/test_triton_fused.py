"""The GPU's fused element-wise kernels against the torch arithmetic they replace
(compiled on a GPU; under Triton's interpreter on the CPU, chosen in conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
triton_fused = pytest.importorskip("carpool.models.triton_fused")

DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("width", [64, 576, 1000])
def test_add_rms_norm_gives_the_norm_of_the_sum_and_the_sum(width: int) -> None:
    x = torch.randn(5, width, device=DEVICE)
    residual = torch.randn(5, width, device=DEVICE)
    weight = torch.rand(width, device=DEVICE) + 0.5
    out, summed = triton_fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)
    want = F.rms_norm(x + residual, (width,), weight, 1e-5)
    assert (out - want).abs().max() < 1e-5


@pytest.mark.parametrize("width", [64, 1536, 3000])
def test_silu_and_mul_multiplies_the_gates_silu_by_the_up_half(width: int) -> None:
    x = torch.randn(3, 2 * width, device=DEVICE) * 4
    gate, up = x.chunk(2, dim=-1)
    # Relative: products reach ~50 here, where float32's few ulps of a different
    # exp (1.5e-5 seen on an H200) exceed any fixed absolute tolerance.
    torch.testing.assert_close(
        triton_fused.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6
    )


def test_shapes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        triton_fused.add_rms_norm(
            torch.zeros(2, 8, device=DEVICE),
            torch.zeros(2, 8, device=DEVICE),
            torch.ones(4, device=DEVICE),
            1e-5,
        )
    with pytest.raises(ValueError, match="2 \\* width"):
        triton_fused.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
