"""Rotary position embeddings (Hugging Face's rotate-half layout), with the
config's scaling: none, ``linear``, ``dynamic``, ``yarn``, ``longrope`` (Phi-3's
``su``) or ``llama3``, as transformers computes them.

Tables hold cos/sin per position up to the model's context, each angle once: the
rotate-half layout turns both halves of a head by the same angles, so a row is
``head_dim / 2`` wide (a Llama 3 file's 131,072 positions at head_dim 64: 32 MiB
rather than 64). A kind is its inverse frequencies (and, for yarn and longrope, a
factor on cos/sin). ``dynamic`` (NTK) changes the base only past
``max_position_embeddings``, where no table reaches: within the context it is the
default. ``longrope`` uses its short factors up to
``original_max_position_embeddings`` and its long ones past it, position by
position (transformers switches every position once a sequence grows past it; the
two agree on sequences within it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from carpool.models.decoder_config import ROPE_KINDS


def _base_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """The inverse frequencies of the kinds whose tables are one set of frequencies."""
    inv_freq = _base_frequencies(head_dim, theta)
    kind = scaling.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_KINDS)})")


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim / 2] for every position: the angles of
    both halves of a head."""
    kind = scaling.get("rope_type", "default")
    positions = torch.arange(max_positions, dtype=torch.float32)
    factor = 1.0
    if kind == "yarn":
        inv_freq, factor = _yarn(head_dim, theta, max_positions, scaling)
        freqs = torch.outer(positions, inv_freq)
    elif kind in ("longrope", "su"):
        short, long, factor = _longrope(head_dim, theta, max_positions, scaling)
        original = int(scaling["original_max_position_embeddings"])
        freqs = torch.where(
            positions[:, None] < original,
            torch.outer(positions, short),
            torch.outer(positions, long),
        )
    else:
        freqs = torch.outer(positions, inverse_frequencies(head_dim, theta, scaling))
    return freqs.cos() * factor, freqs.sin() * factor


def _yarn(
    head_dim: int, theta: float, max_positions: int, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies (interpolated below the correction range, extrapolated
    above, ramped between) and its attention factor."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_positions / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = _base_frequencies(head_dim, theta)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _longrope(
    head_dim: int, theta: float, max_positions: int, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE's short and long frequencies and its attention factor."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = _base_frequencies(head_dim, theta)
    short = base / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    long = base / torch.tensor(scaling["long_factor"], dtype=torch.float32)
    return short, long, float(attention)


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [positions, head_dim / 2] for every position up to the model's
    context (``rope_tables``), looked up per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Mapping[str, Any]):
        super().__init__()
        self.settings = (head_dim, max_positions, theta, dict(scaling))
        if torch.get_default_device().type == "meta":
            # A model built without data (``reset`` computes the tables later): the
            # tables' arithmetic on the meta device would import torch's compiler
            # (~1 s and tens of MiB) for tensors that hold nothing.
            cos = sin = torch.empty(max_positions, head_dim // 2)
        else:
            cos, sin = rope_tables(head_dim, max_positions, theta, scaling)
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def reset(self, device: str | torch.device) -> None:
        """Compute the tables again on ``device`` (a model built on the meta device
        has none: they are not in checkpoints)."""
        cos, sin = rope_tables(*self.settings)
        self.cos_table, self.sin_table = cos.to(device), sin.to(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: [T, H, D], ``k``: [T, Hkv, D], ``positions``: [T]."""
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
