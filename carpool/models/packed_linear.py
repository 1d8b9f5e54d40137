"""Linear layers that also keep their weight in a GGUF file's blocks, in one of
six layouts (``BlockType``; ``carpool.models.gguf_blocks`` maps the file's types
onto them), and run steps of up to ``MAX_KERNEL_ROWS`` rows (every step, where the
blocks alone hold the weight) with the C kernel ``kernels/quantized_linear.c``.

A decode step of one or a few streams is bound by reading the weights; the blocks
are 6 (Q4_1, Q5_0), 7 (Q5_1), 9 (Q8_0) or 10-12 (Q8_16) bits a weight instead of
float32's 32, and a K-quant's (Q4_K, Q5_K, Q6_K) 4.5, 5.5 and 6.5625 with its
file's own scales in their bits (``PackedWeight.lean``; a fused projection whose
parts differ, part by part: ``FusedPacked``). A step of tens of streams is bound by
arithmetic; the kernel then dequantizes strips of the weight
once per step and runs its own register-tiled GEMM. Each weight the kernel uses is
the float32 the file defines, the same value the float32 matrix holds (checked
when the blocks are attached), so only the summation order differs from torch's
float32 GEMM, which runs larger steps here (prompt chunks) when the model does not
run them on its fused stack (``carpool.models.llama_stack``, any number of rows).

With ``--weight-kernel native-int8`` a matrix is held instead interleaved 16 output
features at a time (``Interleaved``; a fused projection whose parts differ, part by
part: ``FusedInterleaved``) in about its file's bits, the K-quants (Q4_K, Q5_K, Q6_K)
with their own scales, and every step's rows use integer dot products on it; a tied
embedding looks its rows up in the head's copy.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from carpool.models.native import KernelUnavailable, check_shape, check_tensors, load_library
from carpool.models.weights import read_tensor

BLOCK = 32
# Rows up to which the kernel beats torch's float32 GEMM (MKL) here, with
# SmolLM2-135M's shapes on the 2-core CI machine: reading the blocks directly wins
# by 3-4x at 1 row; the kernel's own GEMM over dequantized strips ran at 125-158
# GFLOP/s against MKL's 70-125 at 64 rows (the LM head: 158 vs 70), about even at
# 128, and behind on some shapes at 256.
MAX_KERNEL_ROWS = 128


class BlockType(Enum):
    Q4_1 = "Q4_1"  # 4-bit quants, a scale and a min per 32
    Q8_0 = "Q8_0"  # int8 quants, a scale per 32
    Q8_16 = "Q8_16"  # int8 quants, a scale and optionally a min per 16 (mixed parts stacked)
    Q5_1 = "Q5_1"  # 5-bit quants (Q4_1's nibbles and a plane of fifth bits), scale and min
    Q5_0 = "Q5_0"  # Q5_1's bytes, a scale per 32 and no min: w = scale * (q - 16)
    # Q6_K's 6-bit quants (Q4_1's nibbles, two lanes of bits 4-5), a scale per 16, no
    # min: w = scale * (q - 32)
    Q6_16 = "Q6_16"


HALF = 16  # Q8_16's and Q6_16's weights per scale
SUPER = 8  # blocks of 32 in a K-quant's super-block (256 weights)
Q5_BYTES = 20  # a Q5_1 or Q5_0 block in memory: 16 bytes of nibbles, then 4 of fifth bits
Q6_BYTES = 24  # a Q6_16 block: 16 bytes of nibbles, then two lanes of bits 4-5 (``six_bit_lanes``)
FIVE_BITS = (BlockType.Q5_1, BlockType.Q5_0)
NIBBLES = (BlockType.Q4_1, BlockType.Q5_1, BlockType.Q5_0)  # quants held as uint8 bit fields
PER_16 = (BlockType.Q8_16, BlockType.Q6_16)  # a scale (and min) per 16 weights


K_BYTES = 12  # a Q4_K or Q5_K super-block's 8 sc and 8 m, 6 bits each, in its file


@dataclass(frozen=True)
class KScales:
    """A K-quant matrix's scales (and mins) as its file holds them, in its bits. Q4_K,
    Q5_K: block j's scale is ``d * sc`` and its min ``-dmin * m``, ``d`` and ``-dmin``
    (float16) per super-block of ``SUPER`` blocks, their 8 ``sc`` and 8 ``m`` in the
    file's 12 bytes (6 bits each, ``pack_k_scales``). Q6_K (``six_bit``): ``d`` per
    super-block and a signed ``sc`` (int8) per 16 weights, each half-block's scale
    ``d * sc``. Each product is exact in float32 (a float16 times an integer below
    128): the floats of the matrix's ``PackedWeight.scales`` and ``mins``, in a quarter
    of their bytes (Q6_K's: under a third)."""

    supers: torch.Tensor  # [n, k/256, 2] float16: d, -dmin; Q6_K: [n, k/256, 1], d
    factors: torch.Tensor  # [n, k/256, K_BYTES] uint8: sc and m; Q6_K: [n, k/32, 2] int8

    @property
    def six_bit(self) -> bool:
        """Whether these are Q6_K's (a scale per 16 weights, no mins)."""
        return self.factors.dtype == torch.int8

    def pairs(self) -> torch.Tensor:
        """Each block's factors, [n, k/32, 2]: Q4_K's and Q5_K's sc and m (uint8);
        Q6_K's two halves' sc (int8)."""
        return self.factors if self.six_bit else unpack_k_scales(self.factors)

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 scales and mins [n, k/32] they make; Q6_K's scales [n, k/16]
        (``BlockType.Q6_16``'s) and no mins."""
        per_block = self.supers.float().repeat_interleave(SUPER, dim=1)
        made = per_block * self.pairs().to(torch.float32)
        if self.six_bit:
            return made.reshape(made.shape[0], -1), None
        return made[..., 0], made[..., 1]

    def rows(self, order: torch.Tensor) -> KScales:
        return KScales(self.supers[order].contiguous(), self.factors[order].contiguous())


def pack_k_scales(pairs: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's sc and m per block, ``[n, k/32, 2]`` uint8 (each below 64), in
    their file's 12 bytes a super-block, ``[n, k/256, K_BYTES]``: blocks 0-3's sc in
    bytes 0-3 and their m in bytes 4-7 (bits 0-5); blocks 4-7's low four bits in bytes
    8-11 (sc in bits 0-3, m in 4-7) and their top two bits in bits 6-7 of bytes 0-3
    (sc) and 4-7 (m). ValueError where a value needs more than 6 bits."""
    if pairs.numel() and int(pairs.max()) >= 64:
        raise ValueError("Q4_K's and Q5_K's scales and mins hold 6 bits")
    n, groups = pairs.shape[:2]
    blocks = pairs.reshape(n, groups // SUPER, SUPER, 2)
    sc, m = blocks[..., 0], blocks[..., 1]
    top = torch.cat([sc[..., 4:], m[..., 4:]], -1) >> 4
    low = torch.cat([sc[..., :4], m[..., :4]], -1) | (top << 6)
    rest = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat([low, rest], -1).contiguous()


def unpack_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """``pack_k_scales`` undone: [n, k/256, K_BYTES] -> [n, k/32, 2] uint8."""
    n, supers = packed.shape[:2]
    first, rest = packed[..., :8], packed[..., 8:]
    top = first >> 6
    sc = torch.cat([first[..., :4] & 63, (rest & 15) | (top[..., :4] << 4)], -1)
    m = torch.cat([first[..., 4:] & 63, (rest >> 4) | (top[..., 4:] << 4)], -1)
    return torch.stack([sc, m], -1).view(n, supers * SUPER, 2)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [n, k] in blocks of 32 along k: w = scale * q (+ min for Q4_1 and Q5_1, and
    for Q8_16 where it has mins; Q5_0's scale * (q - 16), Q6_16's scale * (q - 32));
    Q8_16's and Q6_16's scale and min change every 16 weights."""

    kind: BlockType
    # Q4_1: [n, k/32, 16] uint8 (two per byte); Q8_*: [n, k/32, 32] int8; Q5_*: [n, k/32,
    # 20] uint8, Q4_1's 16 bytes then 4 (little-endian) whose bit j is weight j's fifth;
    # Q6_16: [n, k/32, 24] uint8 (``six_bit_lanes``)
    quants: torch.Tensor
    # [n, k/32] float32; Q8_16, Q6_16: [n, k/16]; None where k_scales make them (``lean``)
    scales: torch.Tensor | None
    # like scales; Q4_1, Q5_1 always (None where k_scales make them), Q8_16 optionally
    mins: torch.Tensor | None
    # Q4_1's, Q5_1's and Q6_16's made from Q4_K, Q5_K and Q6_K: the file's scales, which
    # make scales and mins exactly (the interleaved copy keeps these instead, and so
    # does a ``lean`` weight)
    k_scales: KScales | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0], self.quants.shape[1] * BLOCK

    @property
    def is_lean(self) -> bool:
        """Whether the K-quant's own scales alone hold the scales (``lean``)."""
        return self.scales is None

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 scales and mins: held, or made from the K-quant's own."""
        if self.scales is not None:
            return self.scales, self.mins
        if self.k_scales is None:
            raise ValueError("blocks without scales need their K-quant scales")
        return self.k_scales.scales_and_mins()

    def lean(self) -> PackedWeight:
        """The same weight holding only the K-quant's own scales (Q4_K in 4.5 bits a
        weight instead of 6, Q5_K in 5.5 instead of 7, Q6_K in 6.5625 instead of 8),
        which the native kernels make the float32 scales and mins from as they read
        them; itself where it has none, or where it is not such a matrix (a Q8_16 of
        other parts, a k not whole super-blocks). ValueError where the K-quant
        scales do not make the held ones."""
        if self.scales is None or not _k_scaled(self):
            return self
        self.check_k_scales()
        return replace(self, scales=None, mins=None)

    def check_k_scales(self) -> None:
        """Raise ValueError where the K-quant scales do not make the held float32
        scales and mins, bit for bit (nothing to compare where either is missing)."""
        if self.k_scales is None or self.scales is None:
            return
        scales, mins = self.k_scales.scales_and_mins()
        if not (_same(scales, self.scales) and _same(mins, self.mins)):
            raise ValueError("the K-quant scales do not make the blocks' scales and mins")

    @staticmethod
    def stack(parts: list[PackedWeight]) -> PackedWeight:
        """The rows of ``parts`` one after another (a fused projection). Parts of
        different layouts are given in one that holds each of them exactly: Q8_0 for
        Q5_0 beside Q8_0 (a Q4_K_M file's query beside its value), else Q8_16 (its
        Q4_K query beside a Q6_K value); a part without mins beside one with them gets
        zeros. One part is returned as it is, not copied (a tied head shares its
        embedding's blocks). The K-quants' scales are kept where every part has them."""
        if len(parts) == 1:
            return parts[0]
        kind = parts[0].kind
        k_scales = None
        if all(p.kind is kind and p.k_scales is not None for p in parts):
            k_scales = KScales(
                torch.cat([p.k_scales.supers for p in parts if p.k_scales is not None]),
                torch.cat([p.k_scales.factors for p in parts if p.k_scales is not None]),
            )
        if all(p.kind in (BlockType.Q5_0, BlockType.Q8_0) for p in parts) and any(
            p.kind is not kind for p in parts
        ):
            parts, kind = [p.as_q8_0() for p in parts], BlockType.Q8_0
        elif any(p.kind is not kind for p in parts):
            parts, kind = [p.as_q8_16() for p in parts], BlockType.Q8_16
        made = [p.float_scales() for p in parts]
        mins = None
        if any(m is not None for _, m in made):
            mins = torch.cat([torch.zeros_like(s) if m is None else m for s, m in made])
        return PackedWeight(
            kind,
            torch.cat([p.quants for p in parts]),
            torch.cat([s for s, _ in made]),
            mins,
            k_scales,
        )

    def as_q8_0(self) -> PackedWeight:
        """Q5_0's weights in the Q8_0 layout (its signed quants one a byte)."""
        if self.kind is BlockType.Q8_0:
            return self
        if self.kind is not BlockType.Q5_0:
            raise ValueError(f"{self.kind.value} blocks have no Q8_0 form")
        return PackedWeight(BlockType.Q8_0, self.signed_quants(), self.float_scales()[0], None)

    def as_q8_16(self) -> PackedWeight:
        """The same weights in the Q8_16 layout (each scale and min given twice, but
        Q6_16's, which are per 16 already)."""
        if self.kind is BlockType.Q8_16:
            return self
        if self.kind is BlockType.Q6_16:
            return PackedWeight(BlockType.Q8_16, self.signed_quants(), self.float_scales()[0], None)
        quants = self.quants
        if self.kind is BlockType.Q5_0:
            quants = self.signed_quants()
        elif self.kind in NIBBLES:
            quants = self.integer_quants().to(torch.int8)
        scales, mins = self.float_scales()
        twice = None if mins is None else mins.repeat_interleave(2, dim=-1)
        return PackedWeight(BlockType.Q8_16, quants, scales.repeat_interleave(2, dim=-1), twice)

    def permute_rows(self, order: torch.Tensor) -> PackedWeight:
        return self._picked(order)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` of the weight, [*ids.shape, k] (an embedding's
        lookup, dequantizing those rows only)."""
        return self._picked(ids.reshape(-1)).dequantize().view(*ids.shape, -1)

    def _picked(self, order: torch.Tensor) -> PackedWeight:
        """The rows ``order`` (indices) alone, with their scales, mins and K-quant
        scales, each a tensor of its own."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[order].contiguous()

        k_scales = None if self.k_scales is None else self.k_scales.rows(order)
        quants = self.quants[order].contiguous()
        return PackedWeight(self.kind, quants, pick(self.scales), pick(self.mins), k_scales)

    def integer_quants(self) -> torch.Tensor:
        """Q4_1's, Q5_1's and Q5_0's stored quants one a weight (0-15 or 0-31),
        [n, k/32, 32] uint8."""
        nibbles = self.quants[..., :16]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
        if self.kind in FIVE_BITS:
            bits = self.quants[..., 16:].to(torch.int64)
            word = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
            fifth = (word[..., None] >> torch.arange(32)) & 1
            q = q | (fifth << 4).to(torch.uint8)
        return q

    def signed_quants(self) -> torch.Tensor:
        """Q5_0's quants minus 16, or Q6_16's minus 32, one a weight, [n, k/32, 32] int8."""
        if self.kind is BlockType.Q6_16:
            return _six_bit_quants(self.quants)
        return (self.integer_quants().to(torch.int8) - 16).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k], computed as the gguf package does."""
        n, k = self.shape
        scales, mins = self.float_scales()
        if self.kind is BlockType.Q5_0:
            return (scales[..., None] * self.signed_quants().float()).view(n, k)
        if self.kind in (BlockType.Q4_1, BlockType.Q5_1):
            assert mins is not None
            q = self.integer_quants().float()
            return (scales[..., None] * q + mins[..., None]).view(n, k)
        if self.kind in PER_16:
            q = self.signed_quants() if self.kind is BlockType.Q6_16 else self.quants
            w = scales[..., None] * q.float().view(n, -1, HALF)
            if mins is not None:
                w = w + mins[..., None]
            return w.view(n, k)
        return (scales[..., None] * self.quants.float()).view(n, k)


FEATURES = 16  # kernels/interleaved.h: output features interleaved together
# quantized_dot.h's numbers for the block kinds
KIND_CODES = {
    BlockType.Q4_1: 0,
    BlockType.Q8_0: 1,
    BlockType.Q8_16: 2,
    BlockType.Q5_1: 3,
    BlockType.Q5_0: 4,
    BlockType.Q6_16: 8,
}
INTERLEAVED_KINDS = (BlockType.Q4_1, BlockType.Q8_0, BlockType.Q5_1, BlockType.Q5_0)
# kernels/interleaved.h's Q4_K, Q5_K and Q6_K: Q4_1's, Q5_1's and Q6_16's quants with
# KScales
K_SCALE_CODES = {BlockType.Q4_1: 5, BlockType.Q5_1: 6, BlockType.Q6_16: 7}


def _k_scaled(packed: PackedWeight) -> bool:
    """Whether ``packed``'s K-quant scales alone can give the kernels its scales: Q4_K's
    and Q5_K's for Q4_1 and Q5_1 blocks, Q6_K's for Q6_16 blocks."""
    if packed.k_scales is None or packed.kind not in K_SCALE_CODES:
        return False
    return packed.k_scales.six_bit == (packed.kind is BlockType.Q6_16)


@dataclass(frozen=True)
class Interleaved:
    """A weight's blocks interleaved ``FEATURES`` output features at a time, for
    ``--weight-kernel native-int8`` (``kernels/interleaved.h`` has the layouts): the
    file's quants and scales in the order that lets one vector instruction advance
    several features' dot products."""

    kind: BlockType
    # [n/16, k/32, lanes, 16, 4]: 4 bytes of each of 16 features per lane; Q4_1: 4 lanes
    # of nibbles, uint8; Q5_*: those 4 and a lane of fifth bits, uint8; Q8_0: 8, int8;
    # Q6_K (Q6_16 with k_scales): 4 of nibbles and 2 of bits 4-5, uint8
    quants: torch.Tensor
    # [n/16, k/32, 16] float16 (the file's: each a float32 exactly); with k_scales
    # KScales.factors: Q4_K's and Q5_K's [n/16, k/256, K_SCALE_BYTES] uint8 in their
    # 6 bits (``six_bit_pairs``), Q6_K's [n/16, k/32, 2, 16] int8
    scales: torch.Tensor
    # Q4_1, Q5_1: the mins, like scales; Q8_0: each block's quant sum, int16; Q5_0:
    # None; with k_scales [n/16, k/256, 2, 16] float16 (KScales.supers; Q6_K's [.., 1, 16])
    extra: torch.Tensor | None
    shape: tuple[int, int]
    k_scales: bool = False  # Q4_1, Q5_1 or Q8_16 whose scales are a K-quant's (KScales)

    @property
    def code(self) -> int:
        """The kind's number on the C side."""
        return K_SCALE_CODES[self.kind] if self.k_scales else KIND_CODES[self.kind]

    @staticmethod
    def of(packed: PackedWeight) -> Interleaved | None:
        """``packed`` interleaved; None unless its rows are a multiple of 16 and it is
        Q4_1, Q8_0, Q5_1, Q5_0 or Q6_K's Q6_16 (a Q8_16, or a Q6_16 without its
        ``KScales``, has no interleaved kernel: its int8 dot products run on the
        few-rows kernels, more rows exact).
        Blocks with the K-quants' scales keep those (``KScales``) instead of float32
        scales and mins, ValueError if they do not make them; the others keep their
        scales and mins as float16, a file's own: None where they are not (a K-quant's
        products without its ``KScales``), which the few-rows kernels then run."""
        n, k = packed.shape
        six_bit = packed.k_scales is not None and packed.k_scales.six_bit
        if n % FEATURES or (packed.kind not in INTERLEAVED_KINDS and not six_bit):
            return None
        if six_bit and packed.kind is not BlockType.Q6_16:
            raise ValueError("Q6_K's scales belong to Q6_16 blocks")
        strips, groups = n // FEATURES, k // BLOCK
        k_scales = packed.k_scales if packed.kind in K_SCALE_CODES else None
        if k_scales is not None:
            packed.check_k_scales()
            floats: list[torch.Tensor] = [k_scales.supers]
        else:
            held_scales, held_mins = packed.float_scales()
            floats = [held_scales] + ([] if held_mins is None else [held_mins])
        if not all(_halves_hold(t) for t in floats):
            return None  # known before the quants are interleaved for nothing
        quants = _interleaved_quants(packed)

        def by_strip(t: torch.Tensor) -> torch.Tensor:
            return t.view(strips, FEATURES, groups).permute(0, 2, 1).contiguous()

        if k_scales is not None:

            def by_strip_pairs(t: torch.Tensor) -> torch.Tensor:
                shape = (strips, FEATURES, *t.shape[1:])
                return t.view(shape).permute(0, 2, 3, 1).contiguous()

            factors = by_strip_pairs(k_scales.pairs())
            return Interleaved(
                packed.kind,
                quants,
                factors if six_bit else six_bit_pairs(factors),
                by_strip_pairs(k_scales.supers),
                (n, k),
                True,
            )
        extra: torch.Tensor | None = None
        if packed.kind in (BlockType.Q4_1, BlockType.Q5_1):
            assert held_mins is not None
            extra = by_strip(held_mins.to(torch.float16))
        elif packed.kind is BlockType.Q8_0:
            sums = torch.empty(n, groups, dtype=torch.int16)  # 32 int8: within +-4,096
            for i in range(0, n, INTERLEAVE_ROWS):  # summed as int32: 4 bytes a weight at once
                sums[i : i + INTERLEAVE_ROWS] = packed.quants[i : i + INTERLEAVE_ROWS].sum(
                    -1, dtype=torch.int32
                )
            extra = by_strip(sums)
        scales = by_strip(held_scales.to(torch.float16))
        return Interleaved(packed.kind, quants, scales, extra, (n, k))

    def strips(self, chosen: torch.Tensor) -> Interleaved:
        """The strips ``chosen`` (indices) of 16 output features alone."""
        extra = None if self.extra is None else self.extra[chosen]
        shape = (len(chosen) * FEATURES, self.shape[1])
        return replace(
            self, quants=self.quants[chosen], scales=self.scales[chosen], extra=extra, shape=shape
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``ids`` of the weight, [*ids.shape, k]: an embedding's
        lookup in a tied head's copy, the strips holding them laid out as the file's
        blocks and only their rows dequantized."""
        flat = ids.reshape(-1)
        strips, where = torch.unique(flat // FEATURES, return_inverse=True)
        packed = self.strips(strips).deinterleave()
        return packed.rows(where * FEATURES + flat % FEATURES).view(*ids.shape, -1)

    def deinterleave(self) -> PackedWeight:
        """The file's layout again."""
        n, k = self.shape
        groups = k // BLOCK

        def by_feature(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(n, groups)

        quants = self.quants.permute(0, 3, 1, 2, 4).reshape(n, groups, -1)
        with_mins = self.kind in (BlockType.Q4_1, BlockType.Q5_1)
        k_scales = None
        mins: torch.Tensor | None
        if self.k_scales:
            assert self.extra is not None

            def pairs(t: torch.Tensor) -> torch.Tensor:
                return t.permute(0, 3, 1, 2).reshape(n, t.shape[1], t.shape[2])

            if self.kind is BlockType.Q6_16:
                k_scales = KScales(pairs(self.extra), pairs(self.scales))
            else:
                factors = pack_k_scales(pairs(_unpacked_pairs(self.scales)))
                k_scales = KScales(pairs(self.extra), factors)
            scales, mins = k_scales.scales_and_mins()
            if k_scales.six_bit:
                return PackedWeight(self.kind, quants.contiguous(), scales, None, k_scales)
        else:
            scales = by_feature(self.scales).float()
            mins = by_feature(self.extra).float() if with_mins and self.extra is not None else None
        if self.kind in FIVE_BITS:
            nibbles, lane = quants[..., :16], quants[..., 16:].to(torch.int64)
            # byte b's bit j is weight 4j + b's fifth bit
            fifth = ((lane[..., None, :] >> torch.arange(8)[:, None]) & 1).reshape(n, groups, 32)
            q = torch.cat([nibbles & 15, nibbles >> 4], -1) | (fifth << 4).to(torch.uint8)
            return q5_blocks(
                self.kind,
                q.reshape(n, k).numpy(),
                n,
                scales.numpy(),
                None if mins is None else mins.numpy(),
                k_scales,
            )
        return PackedWeight(self.kind, quants, scales, mins, k_scales)


MAX_PARTS = 3  # kernels/interleaved.h: a fused projection's parts at most


@dataclass(frozen=True)
class FusedInterleaved:
    """A fused projection whose parts' layouts differ (a Q4_K_M file's Q4_K query and
    key beside its Q6_K value; Q5_0 beside Q8_0), each part interleaved in its own:
    their output features one after another, every part in its file's bits (stacked
    in one layout they would take the widest, Q8_16 with mins for the first)."""

    parts: tuple[Interleaved, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @staticmethod
    def of(parts: list[PackedWeight]) -> FusedInterleaved | None:
        """``parts`` each interleaved; None unless each can be and there are 2 to
        ``MAX_PARTS`` of them."""
        if not 2 <= len(parts) <= MAX_PARTS:
            return None
        interleaved = [Interleaved.of(p) for p in parts]
        if any(i is None for i in interleaved):
            return None
        return FusedInterleaved(tuple(i for i in interleaved if i is not None))


def interleaved_parts(weight: Interleaved | FusedInterleaved) -> tuple[Interleaved, ...]:
    return weight.parts if isinstance(weight, FusedInterleaved) else (weight,)


@dataclass(frozen=True)
class FusedPacked:
    """A fused projection whose parts' layouts differ, in the file's layout part by
    part (a Q4_K_M file's Q4_K query and key beside its Q6_K value: 4.5 and 6.5625
    bits a weight, where stacked in one layout they would take Q8_16 with float32
    scales and mins, 12; Q5_0 beside Q8_0: 6 and 9, stacked 9): their output features
    one after another."""

    parts: tuple[PackedWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def lean(self) -> FusedPacked:
        """Each part ``PackedWeight.lean``."""
        return FusedPacked(tuple(p.lean() for p in self.parts))


def packed_parts(weight: PackedWeight | FusedPacked) -> tuple[PackedWeight, ...]:
    return weight.parts if isinstance(weight, FusedPacked) else (weight,)


INTERLEAVE_ROWS = 4096  # rows converted at a time (of FEATURES): a head's temporaries stay small


def _halves_hold(values: torch.Tensor) -> bool:
    """Whether float16 holds each of ``values`` (float32) exactly, as a file's scales
    and mins: the interleaved copy keeps them in its 2 bytes."""
    return torch.equal(values.to(torch.float16).to(values.dtype), values)


def _interleaved_quants(packed: PackedWeight) -> torch.Tensor:
    """``packed``'s quants in the interleaved layout, [n/16, k/32, lanes, 16, 4]: each
    feature's block as the kernel's lanes (Q5's fifth bits in a lane of their own;
    Q6_16's bytes as they are), a feature's 4 bytes at a time, the 16 features side by
    side; ``INTERLEAVE_ROWS`` rows at a time."""
    n, k = packed.shape
    groups, lanes = k // BLOCK, interleaved_lanes(packed.kind)
    dtype = torch.int8 if packed.kind is BlockType.Q8_0 else torch.uint8
    out = torch.empty(n // FEATURES, groups, lanes, FEATURES, 4, dtype=dtype)
    for start in range(0, n, INTERLEAVE_ROWS):
        q = packed.quants[start : start + INTERLEAVE_ROWS]
        if packed.kind in FIVE_BITS:
            q = torch.cat([q[..., :16], fifth_bit_lane(q[..., 16:])], -1)
        strips = q.shape[0] // FEATURES
        by_strip = q.reshape(strips, FEATURES, groups, lanes, 4).permute(0, 2, 3, 1, 4)
        out[start // FEATURES : start // FEATURES + strips] = by_strip
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bit for bit but NaNs (a broken file's scales), which equal each other
    (or both None); compared ``INTERLEAVE_ROWS`` rows at a time (a head's temporaries
    stay small)."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape:
        return False
    return all(
        torch.allclose(a[i : i + INTERLEAVE_ROWS], b[i : i + INTERLEAVE_ROWS], 0, 0, True)
        for i in range(0, a.shape[0], INTERLEAVE_ROWS)
    )


def interleaved_lanes(kind: BlockType) -> int:
    """The 32-bit lanes a feature's interleaved block fills (Q4_1: four of nibbles;
    Q5_*: those and one of fifth bits; Q8_0: eight of bytes; Q6_16: four of nibbles
    and two of the quants' bits 4 and 5, its blocks' own bytes)."""
    return {
        BlockType.Q4_1: 4,
        BlockType.Q5_1: 5,
        BlockType.Q5_0: 5,
        BlockType.Q8_0: 8,
        BlockType.Q6_16: 6,
    }[kind]


def six_bit_lanes(quants: torch.Tensor) -> torch.Tensor:
    """Q6_K's quants minus 32 ([n, k/32, 32] int8) as a Q6_16 block's 24 bytes, which
    the interleaved Q6_K layout keeps too ([n, k/32, 24] uint8): Q4_1's 16 bytes of
    their low nibbles (weights j and 16 + j in byte j), then two lanes of their bits 4
    and 5: lane h's byte b holds, at bits 2j and 2j + 1, those of weight 16h + 4j + b.
    In uint8 (a wider temporary is several times the quants' size)."""
    q = quants.view(torch.uint8) + 32  # q - 32 in [-32, 31] as uint8, + 32: q in [0, 63]
    out = torch.empty(*q.shape[:-1], 24, dtype=torch.uint8)
    out[..., :16] = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    top = (q >> 4).view(*q.shape[:-1], 2, 4, 4)  # [.., half, j, b]
    lanes = out[..., 16:].view(*q.shape[:-1], 2, 4)
    lanes.zero_()
    for j in range(4):
        lanes |= top[..., j, :] << (2 * j)
    return out


def _six_bit_quants(lanes: torch.Tensor) -> torch.Tensor:
    """``six_bit_lanes`` undone: [..., 24] uint8 -> [..., 32] int8, the quants - 32."""
    nibbles, top = lanes[..., :16], lanes[..., 16:].view(*lanes.shape[:-1], 2, 1, 4)
    high = (top >> (2 * torch.arange(4, dtype=torch.uint8)[:, None])) & 3  # [.., half, j, b]
    q = torch.cat([nibbles & 15, nibbles >> 4], -1) | (high.flatten(-3) << 4)
    return (q.to(torch.int16) - 32).to(torch.int8)


K_SCALE_BYTES = SUPER * 2 * FEATURES * 6 // 8  # kernels/interleaved.h's: a super-block's


def six_bit_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """Q4_K's and Q5_K's scales and mins by strip, ``[strips, k/32, 2, 16]`` uint8 (each
    block's sc of 16 features, then its m; each below 64), in their file's 6 bits as
    the interleaved layout holds them, ``[strips, k/256, K_SCALE_BYTES]`` uint8
    (``kernels/interleaved.h``'s ``unpack_k_scales`` reads them): per super-block,
    byte 16j + f holds the low four bits of block j's sc (bits 0-3) and m (bits 4-7)
    of feature f, then run p's byte i (of two runs of 32) holds bits 4 and 5 of value
    i (sc of feature i below 16, else m of feature i - 16) of block 4p + t at bits 2t
    and 2t + 1. ValueError where a value needs more than 6 bits."""
    if pairs.numel() and int(pairs.max()) >= 64:
        raise ValueError("Q4_K's and Q5_K's scales and mins hold 6 bits")
    strips, groups = pairs.shape[:2]
    values = pairs.reshape(strips, groups // SUPER, SUPER, 2 * FEATURES)  # [.., j, i]
    low = (values[..., :FEATURES] & 15) | ((values[..., FEATURES:] & 15) << 4)
    top = (values >> 4).view(strips, groups // SUPER, 2, 4, 2 * FEATURES)  # [.., p, t, i]
    runs = torch.zeros(strips, groups // SUPER, 2, 2 * FEATURES, dtype=torch.uint8)
    for t in range(4):
        runs |= top[..., t, :] << (2 * t)
    return torch.cat([low.flatten(-2), runs.flatten(-2)], -1).contiguous()


def _unpacked_pairs(packed: torch.Tensor) -> torch.Tensor:
    """``six_bit_pairs`` undone: [strips, k/256, K_SCALE_BYTES] -> [strips, k/32, 2, 16]."""
    strips, supers = packed.shape[:2]
    low = packed[..., : SUPER * FEATURES].view(strips, supers, SUPER, FEATURES)
    runs = packed[..., SUPER * FEATURES :].view(strips, supers, 2, 1, 2 * FEATURES)
    shifts = 2 * torch.arange(4, dtype=torch.uint8)[:, None]
    top = ((runs >> shifts) & 3).view(strips, supers, SUPER, 2 * FEATURES)  # [.., j, i]
    values = torch.cat([low & 15, low >> 4], -1) | (top << 4)
    return values.view(strips, supers * SUPER, 2, FEATURES)


def fifth_bit_lane(word: torch.Tensor) -> torch.Tensor:
    """A Q5 block's fifth bits as its 4 little-endian bytes ([..., 4] uint8: bit i
    of the word is weight i's) to the interleaved Q5 layout's lane, [..., 4] uint8:
    byte b's bit j is weight 4j + b's fifth bit (the weight that nibble lane j's byte
    b holds: j < 4 low nibbles, then high ones). Weight 8m + t's bit is bit t of
    word byte m, so it goes to byte t % 4, bit 2m + t // 4; in uint8 throughout (a
    wider temporary per weight would be several times the model's size)."""
    lane = torch.zeros_like(word)
    b = torch.arange(4, dtype=torch.uint8)
    for m in range(4):
        for half in range(2):
            bits = (word[..., m, None] >> (b + 4 * half)) & 1
            lane |= bits << (2 * m + half)
    return lane


def save_packed(weights: dict[str, PackedWeight], path: Path) -> None:
    """One safetensors file: ``<name>:quants``, ``:scales`` (and ``:mins``, and the
    K-quants' ``:supers`` and ``:factors``) per weight, its block type in the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        scales, mins = w.float_scales()
        tensors[f"{name}:quants"], tensors[f"{name}:scales"] = w.quants, scales
        if mins is not None:
            tensors[f"{name}:mins"] = mins
        if w.k_scales is not None:
            tensors[f"{name}:supers"] = w.k_scales.supers
            tensors[f"{name}:factors"] = w.k_scales.factors
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={n: w.kind.value for n, w in weights.items()})


class BlocksFile(MutableMapping[str, PackedWeight]):
    """The weights of a file ``save_packed`` wrote, each read when it is asked for
    (``read_tensor``: copied out of maps that close after): a model that takes its
    layers' blocks one after another then holds what it took and the one it is taking,
    not the whole file beside them. Deleting a name forgets it (nothing is read);
    nothing can be set."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with safe_open(str(path), framework="pt") as f:
            self._kinds = dict(f.metadata() or {})
            self._tensors = set(f.keys())

    def __getitem__(self, name: str) -> PackedWeight:
        kind = BlockType(self._kinds[name])

        def read(part: str) -> torch.Tensor | None:
            key = f"{name}:{part}"
            return read_tensor(self.path, key) if key in self._tensors else None

        quants, scales = read("quants"), read("scales")
        supers, factors = read("supers"), read("factors")
        if quants is None or scales is None:
            raise ValueError(f"{self.path} has no blocks for {name}")
        k_scales = None if supers is None or factors is None else KScales(supers, factors)
        return PackedWeight(kind, quants, scales, read("mins"), k_scales)

    def __setitem__(self, name: str, weight: PackedWeight) -> None:
        raise TypeError("a blocks file is read, not written")

    def __delitem__(self, name: str) -> None:
        del self._kinds[name]

    def __contains__(self, name: object) -> bool:
        return name in self._kinds  # the mixin's would read the weight

    @property
    def has_k_quants(self) -> bool:
        """Whether any of its weights came from K-quant blocks (Q4_K, Q5_K, Q6_K)."""
        return any(key.endswith(":supers") for key in self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._kinds))

    def __len__(self) -> int:
        return len(self._kinds)


# What the interleaved int8 kernel runs, by its interleaved_vectorized()
INT8_CODES = {
    3: "AMX tiles past 8 rows, AVX-512 VNNI up to 8",
    2: "AVX-512 VNNI",
    1: "AVX2",
    0: "portable C",
}


class QuantizedLinearKernel:
    """y = x @ W^T with W in blocks, for float32 rows x [m, k]. With ``int8_dots``
    (opt-in, ``--weight-kernel native-int8``) x is rounded per block of 32 to int8
    (per 256 for an interleaved K-quant) and the dot products are integer (llama.cpp's
    way): faster, not exact. With a
    weight's ``Interleaved`` copy (or its parts', ``FusedInterleaved``) that is every
    row count (``kernels/interleaved.h``); without one (no AVX2, a Q8_16 weight or a
    Q6_16 without its K-quant scales, or rows not a multiple of 16), steps of up to 8
    rows, larger ones exact."""

    def __init__(self, library: ctypes.CDLL, int8_dots: bool = False) -> None:
        self.int8_dots = int8_dots
        self._interleaved = library.interleaved_int8_linear
        self._interleaved.restype = ctypes.c_int
        self._interleaved.argtypes = [
            ctypes.c_void_p,  # parts
            ctypes.c_int64,  # count
            ctypes.c_void_p,  # x
            ctypes.c_void_p,  # y
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # k
            ctypes.c_int,  # num_threads
        ]
        size = library.interleaved_weight_size
        size.restype = ctypes.c_int64
        if size() != ctypes.sizeof(InterleavedWeightStruct):
            raise KernelUnavailable(
                f"InterleavedWeight is {size()} bytes in C and "
                f"{ctypes.sizeof(InterleavedWeightStruct)} as declared here"
            )
        vectorized = library.interleaved_vectorized
        vectorized.restype = ctypes.c_int64
        # a key of INT8_CODES
        self.interleaved_vectorized = int(vectorized())
        self._q4_1 = library.q4_1_linear
        self._q4_1.restype = ctypes.c_int
        self._q4_1.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._q8_0 = library.q8_0_linear
        self._q8_0.restype = ctypes.c_int
        self._q8_0.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._q8_16 = library.q8_16_linear
        self._q8_16.restype = ctypes.c_int
        self._q8_16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._q5_1 = library.q5_1_linear
        self._q5_1.restype = ctypes.c_int
        self._q5_1.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._q5_0 = library.q5_0_linear
        self._q5_0.restype = ctypes.c_int
        self._q5_0.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._q6_16 = library.q6_16_linear
        self._q6_16.restype = ctypes.c_int
        self._q6_16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self._k_quant = library.k_quant_linear
        self._k_quant.restype = ctypes.c_int
        self._k_quant.argtypes = (
            [ctypes.c_int64] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        )
        self._rows = library.packed_rows
        self._rows.restype = ctypes.c_int
        self._rows.argtypes = (
            [ctypes.c_int64] + [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        )

    @property
    def int8_code(self) -> str:
        """The instructions the interleaved int8 kernel runs here, in words."""
        return INT8_CODES[self.interleaved_vectorized]

    def rows(self, weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """``weight.rows(ids)`` in C: the float32 rows ``ids`` (integers), [*ids.shape, k],
        the same floats. An embedding's lookup without the ~10 torch calls of the
        Python one, each slow at a step's start: the weights' stream has evicted its
        code and data. ValueError for an id outside the weight's rows."""
        self.check_blocks(weight)
        n, k = weight.shape
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], k, dtype=torch.float32)
        k_scales = weight.k_scales if weight.scales is None else None
        failed = self._rows(
            KIND_CODES[weight.kind],
            weight.quants.data_ptr(),
            None if weight.scales is None else weight.scales.data_ptr(),
            None if weight.mins is None else weight.mins.data_ptr(),
            None if k_scales is None else k_scales.supers.data_ptr(),
            None if k_scales is None else k_scales.factors.data_ptr(),
            flat.data_ptr(),
            flat.shape[0],
            n,
            k,
            out.data_ptr(),
        )
        if failed == 2:
            raise ValueError(f"ids outside the {n} rows of the weight")
        if failed:
            raise MemoryError("the rows' scales could not be allocated")
        return out.view(*ids.shape, k)

    def __call__(
        self,
        x: torch.Tensor,
        weight: PackedWeight | FusedPacked | None,
        interleaved: Interleaved | FusedInterleaved | None = None,
    ) -> torch.Tensor:
        """``weight`` in the file's layout (or its parts') and/or ``interleaved``, its
        interleaved copy (or its parts'), which int8 dot products use for any number
        of rows (a layer that keeps only that copy needs them)."""
        if self.int8_dots and interleaved is not None:
            if weight is not None and (
                interleaved.shape != weight.shape
                or (
                    isinstance(interleaved, Interleaved)
                    and isinstance(weight, PackedWeight)
                    and interleaved.kind is not weight.kind
                )
            ):
                raise ValueError("the interleaved blocks are not this weight's")
            return self._run_interleaved(_rows_of(x, interleaved.shape[1]), interleaved)
        if weight is None:
            raise ValueError(
                "without int8 dot products on interleaved blocks, the file's are needed"
            )
        if isinstance(weight, FusedPacked):
            return torch.cat([self(x, part) for part in weight.parts], dim=1)
        n, k = weight.shape
        x = _rows_of(x, k)
        self.check_blocks(weight)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        threads = torch.get_num_threads()
        shape = (x.shape[0], n, k, self.int8_dots, threads)
        if weight.scales is None:
            assert weight.k_scales is not None  # check_blocks
            supers, factors = weight.k_scales.supers, weight.k_scales.factors
            failed = self._k_quant(
                KIND_CODES[weight.kind],
                x.data_ptr(),
                weight.quants.data_ptr(),
                supers.data_ptr(),
                factors.data_ptr(),
                y.data_ptr(),
                *shape,
            )
        elif weight.kind in (BlockType.Q4_1, BlockType.Q5_1, BlockType.Q8_16):
            function = {
                BlockType.Q4_1: self._q4_1,
                BlockType.Q5_1: self._q5_1,
                BlockType.Q8_16: self._q8_16,
            }[weight.kind]
            failed = function(
                x.data_ptr(),
                weight.quants.data_ptr(),
                weight.scales.data_ptr(),
                None if weight.mins is None else weight.mins.data_ptr(),
                y.data_ptr(),
                *shape,
            )
        else:
            function = {BlockType.Q5_0: self._q5_0, BlockType.Q6_16: self._q6_16}.get(
                weight.kind, self._q8_0
            )
            failed = function(
                x.data_ptr(),
                weight.quants.data_ptr(),
                weight.scales.data_ptr(),
                y.data_ptr(),
                *shape,
            )
        if failed:
            raise MemoryError("quantized linear could not allocate its block sums")
        return y

    def _run_interleaved(
        self, x: torch.Tensor, weight: Interleaved | FusedInterleaved
    ) -> torch.Tensor:
        parts = interleaved_structs(weight)
        array = (InterleavedWeightStruct * len(parts))(*parts)
        y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        failed = self._interleaved(
            ctypes.addressof(array),
            len(parts),
            x.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            weight.shape[1],
            torch.get_num_threads(),
        )
        if failed == 2:
            raise ValueError("these blocks have no interleaved kernel")
        if failed:
            raise MemoryError("quantized linear could not allocate its rounded rows")
        return y

    @staticmethod
    def check_blocks(weight: PackedWeight) -> None:
        """Raise ValueError unless the blocks are laid out as the C side reads them."""
        n, k = weight.shape
        if k % 32:
            raise ValueError(f"k = {k} is not a whole number of 32-weight blocks")
        bit_fields = weight.kind in (*NIBBLES, BlockType.Q6_16)
        check_tensors(quants=(weight.quants, torch.uint8 if bit_fields else torch.int8))
        width = {BlockType.Q4_1: 16, BlockType.Q6_16: Q6_BYTES}.get(weight.kind, 32)
        width = Q5_BYTES if weight.kind in FIVE_BITS else width
        check_shape("quants", weight.quants, n, k // 32, width)
        if weight.scales is None:
            _check_k_scales(weight)
            return
        check_tensors(scales=(weight.scales, torch.float32))
        per_scale = HALF if weight.kind in PER_16 else BLOCK
        check_shape("scales", weight.scales, n, k // per_scale)
        with_mins = weight.kind in (BlockType.Q4_1, BlockType.Q5_1)
        if with_mins and weight.mins is None:
            raise ValueError(f"{weight.kind.value} blocks need their mins")
        if (
            weight.kind in (BlockType.Q8_0, BlockType.Q5_0, BlockType.Q6_16)
            and weight.mins is not None
        ):
            raise ValueError(f"{weight.kind.value} blocks have no mins")
        if weight.mins is not None:
            check_tensors(mins=(weight.mins, torch.float32))
            check_shape("mins", weight.mins, n, k // per_scale)


def _check_k_scales(weight: PackedWeight) -> None:
    """Raise ValueError unless a ``lean`` weight's K-quant scales are laid out as the
    C side reads them (quantized_dot.h's KScaleRows)."""
    n, k = weight.shape
    if weight.k_scales is None or not _k_scaled(weight) or weight.mins is not None:
        raise ValueError(f"{weight.kind.value} blocks without scales need a K-quant's own")
    if k % (SUPER * BLOCK):
        raise ValueError(f"k = {k} is not a whole number of 256-weight super-blocks")
    six_bit = weight.k_scales.six_bit
    check_tensors(
        supers=(weight.k_scales.supers, torch.float16),
        factors=(weight.k_scales.factors, torch.int8 if six_bit else torch.uint8),
    )
    supers = k // (SUPER * BLOCK)
    check_shape("supers", weight.k_scales.supers, n, supers, 1 if six_bit else 2)
    if six_bit:
        check_shape("factors", weight.k_scales.factors, n, k // BLOCK, 2)
    else:
        check_shape("factors", weight.k_scales.factors, n, supers, K_BYTES)


class InterleavedWeightStruct(ctypes.Structure):
    """kernels/interleaved.h's InterleavedWeight: one part's blocks."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("quants", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("n", ctypes.c_int64),
    ]


def interleaved_struct(weight: Interleaved) -> InterleavedWeightStruct:
    """``weight``'s part for the C side, checked first (the struct holds pointers
    into its tensors: keep ``weight`` alive while it is used)."""
    check_interleaved(weight)
    extra = None if weight.extra is None else weight.extra.data_ptr()
    return InterleavedWeightStruct(
        weight.code, weight.quants.data_ptr(), weight.scales.data_ptr(), extra, weight.shape[0]
    )


def interleaved_structs(weight: Interleaved | FusedInterleaved) -> list[InterleavedWeightStruct]:
    """The parts of ``weight`` as the C side reads them (see ``interleaved_struct``);
    ValueError where they do not share k or are too many."""
    parts = interleaved_parts(weight)
    if not 1 <= len(parts) <= MAX_PARTS or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"1 to {MAX_PARTS} interleaved parts of one k are needed")
    return [interleaved_struct(p) for p in parts]


def _rows_of(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` as the kernels read it: float32 rows [m, k], contiguous."""
    x = x.contiguous()
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [rows, {k}], got {list(x.shape)}")
    check_tensors(x=(x, torch.float32))
    return x


def check_interleaved(weight: Interleaved) -> None:
    """Raise ValueError unless ``weight`` is laid out as the C side reads it."""
    n, k = weight.shape
    if n % FEATURES or k % BLOCK:
        raise ValueError(f"an interleaved weight needs n % 16 == 0 and k % 32 == 0, got {n}, {k}")
    six_bit = weight.kind is BlockType.Q6_16
    if weight.kind not in INTERLEAVED_KINDS and not (six_bit and weight.k_scales):
        raise ValueError(f"{weight.kind.value} blocks have no interleaved kernel")
    if weight.k_scales and (weight.kind not in K_SCALE_CODES or k % (SUPER * BLOCK)):
        raise ValueError(f"{weight.kind.value} blocks of k {k} cannot have K-quant scales")
    q8 = weight.kind is BlockType.Q8_0
    factors = torch.int8 if six_bit else torch.uint8
    check_tensors(
        quants=(weight.quants, torch.int8 if q8 else torch.uint8),
        scales=(weight.scales, factors if weight.k_scales else torch.float16),
    )
    strips, groups = n // FEATURES, k // BLOCK
    lanes = interleaved_lanes(weight.kind)
    check_shape("quants", weight.quants, strips, groups, lanes, FEATURES, 4)
    if weight.k_scales:
        if six_bit:
            check_shape("scales", weight.scales, strips, groups, 2, FEATURES)
        else:
            check_shape("scales", weight.scales, strips, groups // SUPER, K_SCALE_BYTES)
        if weight.extra is None:
            raise ValueError("interleaved blocks with K-quant scales need their super-blocks'")
        check_tensors(extra=(weight.extra, torch.float16))
        check_shape("extra", weight.extra, strips, groups // SUPER, 1 if six_bit else 2, FEATURES)
        return
    check_shape("scales", weight.scales, strips, groups, FEATURES)
    if weight.kind is BlockType.Q5_0:
        if weight.extra is not None:
            raise ValueError("interleaved Q5_0 blocks have no extra")
        return
    if weight.extra is None:
        raise ValueError(f"interleaved {weight.kind.value} blocks need their extra")
    check_tensors(extra=(weight.extra, torch.int16 if q8 else torch.float16))
    check_shape("extra", weight.extra, strips, groups, FEATURES)


@functools.cache
def quantized_linear_kernel(int8_dots: bool = False) -> QuantizedLinearKernel:
    """The kernel, built once per process; raises KernelUnavailable."""
    return QuantizedLinearKernel(load_library("quantized_linear"), int8_dots)


def without_k_scales(packed: PackedWeight | None) -> PackedWeight | None:
    """``packed`` without its ``KScales`` (the same tensors otherwise)."""
    if packed is None or packed.k_scales is None:
        return packed
    return replace(packed, k_scales=None)


def drop_float(layer: nn.Linear | nn.Embedding) -> None:
    """Give ``layer`` an empty weight: its blocks will hold it (``blocks only``)."""
    layer.weight = nn.Parameter(torch.empty(0, device=layer.weight.device), requires_grad=False)


class Linear(nn.Linear):
    """``nn.Linear`` that runs inputs of at most ``MAX_KERNEL_ROWS`` rows on its
    packed blocks when it has them (``attach``); with no float32 weight beside them
    (``drop_float``: a GGUF model loaded blocks only), every input."""

    packed: PackedWeight | FusedPacked | None = None
    interleaved: Interleaved | FusedInterleaved | None = None
    kernel: QuantizedLinearKernel | None = None

    def reset_parameters(self) -> None:
        if not _on_meta(self.weight):
            super().reset_parameters()

    def attach_parts(self, parts: list[PackedWeight], kernel: QuantizedLinearKernel | None) -> None:
        """``attach`` the rows of ``parts`` one after another (a fused projection);
        where their layouts differ, the file's layout and the interleaved copy keep
        each part's (``FusedPacked``, ``FusedInterleaved``)."""
        layouts = {(p.kind, p.k_scales is not None and p.k_scales.six_bit) for p in parts}
        if len(layouts) == 1 or len(parts) > MAX_PARTS:
            self.attach(PackedWeight.stack(parts), kernel)
            return
        fused = FusedInterleaved.of(parts) if _interleaves(kernel) else None
        # where the interleaved parts alone will hold the weight, the file's would go unused
        alone = fused is not None and not self.weight.numel()
        self.attach(None if alone else FusedPacked(tuple(parts)), kernel, fused)

    def attach(
        self,
        packed: PackedWeight | FusedPacked | None,
        kernel: QuantizedLinearKernel | None,
        fused: FusedInterleaved | None = None,
    ) -> None:
        """Use ``packed`` for few rows; it must hold exactly this layer's weight
        where the layer keeps one. A kernel with int8 dot products also gets the
        blocks interleaved where it has the vector code for them (AVX2 or AVX-512
        VNNI; elsewhere the portable C would be slower than the few-rows int8
        kernels, which then run instead): ``fused``, the parts' own, where given
        (then ``packed`` may be None); a layer without a float32 weight then keeps
        the interleaved copy alone (``packed`` None)."""
        shape = (self.out_features, self.in_features)
        if packed is not None:
            if packed.shape != shape:
                raise ValueError(f"packed {packed.shape} for weight {shape}")
            if self.weight.numel() and not torch.equal(packed.dequantize(), self.weight.detach()):
                raise ValueError("packed blocks do not hold this layer's float32 weight")
        elif not self.weight.numel() and (fused is None or not _interleaves(kernel)):
            raise ValueError("a layer whose blocks hold its weight cannot drop them")
        interleaved: Interleaved | FusedInterleaved | None = None
        if _interleaves(kernel):
            if fused is not None:
                if fused.shape != shape:
                    raise ValueError(f"interleaved parts {fused.shape} for weight {shape}")
                interleaved = fused
            elif isinstance(packed, PackedWeight):
                interleaved = Interleaved.of(packed)
        self.interleaved = interleaved
        # a K-quant's file layout keeps only its own scales (``lean``): the kernels
        # make the float32 ones from them as they read them
        self.packed, self.kernel = None if packed is None else packed.lean(), kernel
        if self.interleaved is not None and not self.weight.numel():
            # the interleaved copy holds the same weights (``deinterleave``) and runs
            # every row: the file's layout would only double their memory
            self.packed = None

    @property
    def has_blocks(self) -> bool:
        """Whether blocks hold this layer's weight (the file's or interleaved)."""
        return self.packed is not None or self.interleaved is not None

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors its blocks are held in (the file's layout and the interleaved
        copy, every part's)."""
        held: list[torch.Tensor | None] = []
        if self.interleaved is not None:
            for part in interleaved_parts(self.interleaved):
                held += [part.quants, part.scales, part.extra]
        if self.packed is not None:
            for packed in packed_parts(self.packed):
                k_scales = packed.k_scales
                held += [packed.quants, packed.scales, packed.mins]
                held += [None, None] if k_scales is None else [k_scales.supers, k_scales.factors]
        return [t for t in held if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.has_blocks
            and self.kernel is not None
            and x.dim() == 2
            and (
                x.shape[0] <= MAX_KERNEL_ROWS
                or self.interleaved is not None
                or not self.weight.numel()
            )
            and x.dtype == torch.float32
        ):
            y = self.kernel(x, self.packed, self.interleaved)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def _interleaves(kernel: QuantizedLinearKernel | None) -> bool:
    """Whether ``kernel`` runs int8 dot products on interleaved blocks' vector code."""
    return kernel is not None and kernel.int8_dots and kernel.interleaved_vectorized > 0


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be a GGUF file's blocks instead (``packed``,
    with ``drop_float``), or a tied head's interleaved copy of them
    (``interleaved``: one copy for both): a lookup dequantizes the rows it reads."""

    packed: PackedWeight | None = None
    interleaved: Interleaved | None = None
    kernel: QuantizedLinearKernel | None = None  # looks ``packed``'s rows up in C

    def reset_parameters(self) -> None:
        if not _on_meta(self.weight):
            super().reset_parameters()

    def share(self, head: Linear) -> None:
        """Look rows up in the tied ``head``'s interleaved copy, where it has one of
        this table's blocks, and drop the file's layout held here."""
        copy = head.interleaved
        if self.packed is None or not isinstance(copy, Interleaved):
            return
        if copy.shape != self.packed.shape or copy.kind is not self.packed.kind:
            raise ValueError("the head's interleaved blocks are not this table's")
        self.interleaved, self.packed = copy, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.interleaved is not None:
            return self.interleaved.rows(ids)
        if self.packed is not None:
            if self.kernel is not None:
                return self.kernel.rows(self.packed, ids)
            return self.packed.rows(ids)
        return super().forward(ids)


def _on_meta(weight: torch.Tensor) -> bool:
    """Whether ``weight`` holds nothing yet (a model built on the meta device to be
    loaded): initializing it there would only import torch's compiler (~1 s and
    ~120 MiB: meta tensors' random fills run through its reference ops)."""
    return weight.device.type == "meta"


def q5_blocks(
    kind: BlockType,
    quants: np.ndarray,
    n: int,
    scales: np.ndarray,
    mins: np.ndarray | None,
    k_scales: KScales | None = None,
) -> PackedWeight:
    """``quants`` [n, k] (0-31 as float) into Q5_1 or Q5_0 blocks: weights j and j +
    16's low nibbles in byte j, then the 32 fifth bits as a little-endian word."""
    q = quants.astype(np.uint8).reshape(n, -1, 32)
    nibbles = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    fifth = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    word = np.bitwise_or.reduce(fifth, axis=-1).astype("<u4")
    bits = word[..., None].view(np.uint8).reshape(n, -1, 4)
    return PackedWeight(
        kind,
        torch.from_numpy(np.ascontiguousarray(np.concatenate([nibbles, bits], axis=-1))),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32)),
        k_scales,
    )
