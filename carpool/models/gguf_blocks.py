"""A GGUF matrix's blocks in the layouts the native kernels read (``PackedWeight``),
each weight exactly the float32 the ``gguf`` package dequantizes it to.

The file's block types map onto six layouts:

- ``Q4_1`` (4-bit quants, a scale and a min per 32): Q4_1 itself, Q4_0 (min -8
  scale) and Q4_K (each sub-block of 32 its own scale ``d * sc`` and min
  ``-dmin * m``): Q4_K_M's bulk, held in the file's 4.5 bits a weight with its ``d``,
  ``dmin``, ``sc`` and ``m`` in their bits (``KScales``, ``PackedWeight.lean``: ``d``
  and ``dmin`` float16, ``sc`` and ``m`` 6 bits each, as the interleaved copy of
  ``--weight-kernel native-int8`` keeps them too), Q4_0 and Q4_1 in 6
  (float32 scales and mins; 5 interleaved, the file's float16);
- ``Q5_1`` (5-bit quants, a scale and a min per 32): Q5_1 itself and Q5_K (as Q4_K),
  7 bits a weight and 5.5 (the files' 6 and 5.5);
- ``Q5_0`` (Q5_1's quants, a scale per 32, no min: w = scale * (q - 16)): Q5_0, 6
  bits a weight (the file's 5.5);
- ``Q8_0`` (int8 quants, a scale per 32): Q8_0 itself, 9 bits;
- ``Q6_16`` (6-bit quants, a scale per 16, no min: w = scale * (q - 32)): Q6_K
  (scales ``d * sc``), in the file's 6.5625 bits a weight with its ``d`` and ``sc``
  (the interleaved copy keeps the same bytes);
- ``Q8_16`` (int8 quants, a scale and optionally a min per 16): a fused projection's
  parts stacked where they differ and cannot be held part by part
  (``PackedWeight.stack``).

The bit fields are unpacked by the ``gguf`` package itself where it can be made to
(its dequantization of the blocks with unit scales gives the integer quants), so
the layouts read here are the ones it reads. Other types (Q2_K, Q3_K, the IQ
types) have no native layout: their layers run on float32 weights.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from carpool.models.packed_linear import (
    BlockType,
    KScales,
    PackedWeight,
    q5_blocks,
    six_bit_lanes,
)

T = GGMLQuantizationType
ONE = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # float16 1.0's two bytes

# Q4_K / Q5_K's 12 scale bytes with every 6-bit scale 1 and every min 0
_UNIT_K_SCALES = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.uint8)

NATIVE_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0)


def to_packed(kind: GGMLQuantizationType, raw: np.ndarray) -> PackedWeight | None:
    """``raw``: the file's rows [n, bytes] of a matrix of ``kind``; None for a type
    with no native layout."""
    n = raw.shape[0]
    if kind is T.Q4_1:
        blocks = raw.reshape(n, -1, 20)
        quants = np.ascontiguousarray(blocks[..., 4:])
        return _q4_1(quants, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))
    if kind is T.Q8_0:
        blocks = raw.reshape(n, -1, 34)
        int8 = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return PackedWeight(BlockType.Q8_0, int8, torch.from_numpy(_f16(blocks[..., 0:2])), None)
    if kind is T.Q4_0:
        blocks = raw.reshape(n, -1, 18)
        d = _f16(blocks[..., 0:2])
        return _q4_1(np.ascontiguousarray(blocks[..., 2:]), d, -8 * d)
    if kind is T.Q4_K:
        return _q4_k(raw.reshape(n, -1, 144))
    if kind is T.Q5_0:
        blocks = raw.reshape(n, -1, 22)
        quants = _unit_quants(kind, blocks, [(0, ONE)]) + 16
        return q5_blocks(BlockType.Q5_0, quants, n, _f16(blocks[..., 0:2]), None)
    if kind is T.Q5_1:
        blocks = raw.reshape(n, -1, 24)
        quants = _unit_quants(kind, blocks, [(0, ONE), (2, np.zeros(2, np.uint8))])
        return q5_blocks(BlockType.Q5_1, quants, n, _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))
    if kind is T.Q5_K:
        blocks = raw.reshape(n, -1, 176)
        unit = [(0, ONE), (2, np.zeros(2, np.uint8)), (4, _UNIT_K_SCALES)]
        quants = _unit_quants(kind, blocks, unit)
        scales, mins, k_scales = _k_scales(blocks)
        return q5_blocks(BlockType.Q5_1, quants, n, scales, mins, k_scales)
    if kind is T.Q6_K:
        blocks = raw.reshape(n, -1, 210)
        quants = _unit_quants(kind, blocks, [(192, np.ones(16, np.uint8)), (208, ONE)])
        sc = blocks[..., 192:208].copy().view(np.int8)
        d = blocks[..., 208:210].copy().view(np.float16)  # [n, blocks, 1]
        scales = d.astype(np.float32) * sc.astype(np.float32)  # [n, blocks, 16]
        packed = PackedWeight(
            BlockType.Q6_16,
            six_bit_lanes(_int8(quants, n)),
            torch.from_numpy(np.ascontiguousarray(scales.reshape(n, -1), dtype=np.float32)),
            None,
        )
        k_scales = KScales(
            torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(sc).reshape(n, -1, 2))
        )
        return replace(packed, k_scales=k_scales)
    return None


def _f16(field: np.ndarray) -> np.ndarray:
    """Two bytes a block -> their float16 as float32, [n, blocks]."""
    return field.copy().view(np.float16)[..., 0].astype(np.float32)


def _unit_quants(
    kind: GGMLQuantizationType, blocks: np.ndarray, fields: list[tuple[int, np.ndarray]]
) -> np.ndarray:
    """The integer quants of ``blocks`` [n, blocks, bytes]: the gguf package's
    dequantization of a copy whose scale fields (offset, bytes) are set to one and
    whose mins to zero. Returns [n, k] float32 integers."""
    unit = blocks.copy()
    for offset, value in fields:
        unit[..., offset : offset + len(value)] = value
    n = blocks.shape[0]
    return np.asarray(dequantize(unit.reshape(n, -1), kind), dtype=np.float32).reshape(n, -1)


def _int8(quants: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(quants.astype(np.int8).reshape(n, -1, 32))


def _q4_1(
    quants: np.ndarray, scales: np.ndarray, mins: np.ndarray, k_scales: KScales | None = None
) -> PackedWeight:
    return PackedWeight(
        BlockType.Q4_1,
        torch.from_numpy(quants),
        torch.from_numpy(np.ascontiguousarray(scales)),
        torch.from_numpy(np.ascontiguousarray(mins)),
        k_scales,
    )


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, KScales]:
    """Q4_K / Q5_K: each sub-block of 32's scale ``d * sc`` and min ``-(dmin * m)``,
    [n, blocks * 8] float32, computed as the gguf package computes them; and the
    factors they are made of (``KScales``)."""
    n, count = blocks.shape[:2]
    halves = blocks[..., 0:4].copy().view(np.float16)  # d, dmin
    d, dmin = halves[..., 0].astype(np.float32), halves[..., 1].astype(np.float32)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    sc, m = sc.reshape(n, count, 8), m.reshape(n, count, 8)
    scales = d[..., None] * sc.astype(np.float32)
    mins = -(dmin[..., None] * m.astype(np.float32))
    halves[..., 1] = -halves[..., 1]  # the factor the kernels multiply m by
    k_scales = KScales(
        torch.from_numpy(halves), torch.from_numpy(np.ascontiguousarray(blocks[..., 4:16]))
    )
    return scales.reshape(n, -1), mins.reshape(n, -1), k_scales


def _q4_k(blocks: np.ndarray) -> PackedWeight:
    """Q4_K's 4 chunks of 32 bytes a super-block hold sub-block 2c in the low nibbles
    and 2c + 1 in the high ones; Q4_1 packs weights j and j + 16 of a block in a byte."""
    n, count = blocks.shape[:2]
    qs = blocks[..., 16:].reshape(n, count, 4, 32)
    values = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, count * 8, 32)
    packed = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)
    scales, mins, k_scales = _k_scales(blocks)
    return _q4_1(np.ascontiguousarray(packed), scales, mins, k_scales)
