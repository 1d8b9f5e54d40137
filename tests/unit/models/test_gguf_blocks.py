"""GGUF's quantized types in the native kernels' layouts: every type with a layout
unpacks to exactly the float32 weights the gguf package reads, and a model whose
file is K-quants (Q4_K_M's mix: Q4_K, Q5_K, Q6_K beside Q8_0) runs its linear
layers and its fused stack on them, with the tokens of its float32 weights."""

from __future__ import annotations

import random
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from carpool.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.models import packed_linear
from carpool.models.causal_lm import LoadedLM, load_causal_lm, save_converted
from carpool.models.gguf_blocks import NATIVE_TYPES, to_packed
from carpool.models.gguf_file import GGUFCheckpoint
from carpool.models.packed_linear import (
    BlocksFile,
    BlockType,
    FusedInterleaved,
    FusedPacked,
    Interleaved,
    KScales,
    Linear,
    PackedWeight,
    check_interleaved,
    drop_float,
    interleaved_parts,
    quantized_linear_kernel,
    save_packed,
    without_k_scales,
)
from carpool.workers.factory import engine_for
from tests import tiny_models
from tests.unit.models.test_causal_lm import generate, gguf_writer
from tests.unit.models.test_packed_linear import rounded_rows_product

T = gguf.GGMLQuantizationType
# Each type's (bytes a block, weights a block, where its float16 scale fields are and
# the scale to give them, so a random block's weights stay near those of a model)
BLOCKS = {
    T.Q4_0: (18, 32, [(0, 0.01)]),
    T.Q4_1: (20, 32, [(0, 0.01), (2, -0.05)]),
    T.Q5_0: (22, 32, [(0, 0.005)]),
    T.Q5_1: (24, 32, [(0, 0.005), (2, -0.05)]),
    T.Q8_0: (34, 32, [(0, 0.001)]),
    T.Q4_K: (144, 256, [(0, 2e-4), (2, 1e-3)]),
    T.Q5_K: (176, 256, [(0, 1e-4), (2, 1e-3)]),
    T.Q6_K: (210, 256, [(208, 2e-5)]),
    T.Q2_K: (84, 256, [(80, 1e-3), (82, 1e-3)]),
}


def random_blocks(kind: gguf.GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """[n, bytes] rows of ``kind``: random quants and sub-block scales, float16 scale
    fields drawn near the table's values (any bits there would do, but infinities)."""
    size, per, fields = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for offset, scale in fields:
        values = (scale * rng.uniform(0.5, 1.5, size=(n, k // per))).astype(np.float16)
        raw[..., offset : offset + 2] = values[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def file_weight(kind: gguf.GGMLQuantizationType, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32))


@pytest.mark.parametrize("kind", NATIVE_TYPES, ids=lambda t: t.name)
def test_every_type_with_a_layout_holds_the_weights_gguf_reads(
    kind: gguf.GGMLQuantizationType,
) -> None:
    raw = random_blocks(kind, 24, 512, seed=int(kind))
    packed = to_packed(kind, raw)
    assert packed is not None and packed.shape == (24, 512)
    assert torch.equal(packed.dequantize(), file_weight(kind, raw).view(24, 512))


@pytest.mark.parametrize("kind", NATIVE_TYPES, ids=lambda t: t.name)
def test_the_kernel_looks_up_the_rows_gguf_reads(kind: gguf.GGMLQuantizationType) -> None:
    """An embedding's lookup in C: the rows asked for (repeated, in any order), the
    floats the gguf package makes, from the held scales or (``lean``) the K-quant's own;
    an id outside the rows is refused, not read."""
    raw = random_blocks(kind, 24, 512, seed=int(kind) + 1)
    packed = to_packed(kind, raw)
    assert packed is not None
    kernel = quantized_linear_kernel()
    ids = torch.tensor([[7, 0, 23], [7, 12, 3]])
    expected = file_weight(kind, raw).view(24, 512)[ids]
    weights = [packed] + ([packed.lean()] if packed.k_scales is not None else [])
    for weight in weights:
        assert torch.equal(kernel.rows(weight, ids), expected)
        for bad in (24, -1):
            with pytest.raises(ValueError, match="outside the 24 rows"):
                kernel.rows(weight, torch.tensor([3, bad]))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_the_interleaved_copy_keeps_a_k_quants_own_scales_and_computes_rounded_products(
    kind: gguf.GGMLQuantizationType,
) -> None:
    """Interleaved, a Q4_K or Q5_K matrix keeps its file's d, dmin (float16), sc and m (6
    bits each: 0.5 bits a weight, as its file) in place of float32 scales and mins (2): the
    int8 kernel computes the rounded rows' products with the floats they make (x rounded per
    256, its integer sums scaled by sc and m), each row's the same at every row count.
    Without them its float32 products (not float16's) have no interleaved copy."""
    packed = to_packed(kind, random_blocks(kind, 48, 768, seed=int(kind)))
    assert packed is not None and packed.k_scales is not None
    kernel = quantized_linear_kernel(int8_dots=True)
    if not kernel.interleaved_vectorized:
        pytest.skip("no AVX2: nothing is interleaved")
    compact = Interleaved.of(packed)
    assert compact is not None and compact.k_scales
    assert Interleaved.of(without_k_scales(packed)) is None
    scale_bytes = sum(t.numel() * t.element_size() for t in (compact.scales, compact.extra))
    assert scale_bytes * 8 == 48 * 768 // 2  # 0.5 bits a weight
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(9))
    nine = kernel(x, None, compact)
    torch.testing.assert_close(
        nine.double(),
        rounded_rows_product(x, without_k_scales(packed), super_blocks=True),
        rtol=1e-5,
        atol=1e-5,
    )
    for rows in (1, 3):
        assert torch.equal(kernel(x[:rows], None, compact), nine[:rows])
    back = compact.deinterleave()
    assert torch.equal(back.quants, packed.quants) and back.k_scales is not None
    assert torch.equal(back.scales, packed.scales) and torch.equal(back.mins, packed.mins)
    assert torch.equal(back.k_scales.factors, packed.k_scales.factors)


def test_q6_k_is_interleaved_in_its_own_bits_and_computes_the_rounded_rows_products() -> None:
    """Interleaved, a Q6_K matrix keeps its 6-bit quants, its int8 scale per 16 weights
    and its float16 d per 256 (6.5625 bits a weight, its file's, as the file layout); the
    int8 kernel gives the rounded rows' integer products (x rounded per 256, the blocks'
    integer sums added up over a super-block), a row's bits the same alone or in a step."""
    packed = to_packed(T.Q6_K, random_blocks(T.Q6_K, 48, 768, seed=6))
    assert packed is not None and packed.k_scales is not None and packed.k_scales.six_bit
    kernel = quantized_linear_kernel(int8_dots=True)
    if not kernel.interleaved_vectorized:
        pytest.skip("no AVX2: nothing is interleaved")
    compact = Interleaved.of(packed)
    assert compact is not None and compact.k_scales and compact.code == 7
    held = sum(
        t.numel() * t.element_size() for t in (compact.quants, compact.scales, compact.extra)
    )
    assert held * 8 == 48 * 768 * 6.5625
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(6)) * 3
    x[0, 256:512] = 0.0  # a super-block of zeros: step 0
    together = kernel(x, None, compact)
    expected = rounded_rows_product(x, packed, super_blocks=True)
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=tolerance)
    for r in range(9):
        assert torch.equal(kernel(x[r : r + 1], None, compact)[0], together[r])
    back = compact.deinterleave()
    assert torch.equal(back.quants, packed.quants) and torch.equal(back.scales, packed.scales)
    assert back.mins is None and back.k_scales is not None
    assert torch.equal(back.k_scales.factors, packed.k_scales.factors)
    with pytest.raises(ValueError, match="belong to Q6_16"):
        Interleaved.of(replace(packed.as_q8_16(), k_scales=packed.k_scales))


def fused_interleaved(
    kinds: list[gguf.GGMLQuantizationType], sizes: tuple[int, ...]
) -> tuple[list[PackedWeight], Linear]:
    """Random parts of k = 512 of these kinds and output features, and a layer that runs
    them interleaved part by part (skips without AVX2: nothing is interleaved)."""
    made = [
        to_packed(t, random_blocks(t, n, 512, seed=n)) for t, n in zip(kinds, sizes, strict=True)
    ]
    parts = [p for p in made if p is not None]
    assert len(parts) == len(kinds)
    kernel = quantized_linear_kernel(int8_dots=True)
    if not kernel.interleaved_vectorized:
        pytest.skip("no AVX2: nothing is interleaved")
    layer = Linear(512, sum(sizes), bias=False)
    drop_float(layer)
    layer.attach_parts(parts, kernel)
    assert layer.packed is None and isinstance(layer.interleaved, FusedInterleaved)
    return parts, layer


def each_part_alone(layer: Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """The layer's output on x, which must equal each interleaved part's alone, side by
    side: those parts' outputs."""
    assert isinstance(layer.interleaved, FusedInterleaved)
    kernel = quantized_linear_kernel(int8_dots=True)
    alone = [kernel(x, None, part) for part in layer.interleaved.parts]
    assert torch.equal(layer(x), torch.cat(alone, dim=1))
    return alone


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_a_fused_projection_of_mixed_layouts_keeps_each_parts_own_bits(rows: int) -> None:
    """A Q4_K_M file's Q4_K query and key beside its Q6_K value, interleaved part by
    part: each part in its file's bits (not Q8_16 with mins for all), and each output
    feature the bits its part alone gives (x rounded per 256 for all three)."""
    from tests.unit.models.test_packed_linear import rounded_rows_product

    parts, layer = fused_interleaved([T.Q4_K, T.Q4_K, T.Q6_K], (64, 32, 32))
    assert isinstance(layer.interleaved, FusedInterleaved)
    assert [(p.kind, p.code) for p in layer.interleaved.parts] == [
        (BlockType.Q4_1, 5),
        (BlockType.Q4_1, 5),
        (BlockType.Q6_16, 7),
    ]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    together = torch.cat(each_part_alone(layer, x), dim=1)
    expected = rounded_rows_product(x, PackedWeight.stack(parts), super_blocks=True)
    tolerance = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(together.double(), expected, rtol=1e-5, atol=tolerance)


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_a_fused_projection_rounds_x_for_each_parts_kind(rows: int) -> None:
    """A Q8_0 part reads x rounded per block of 32, the K-quant parts beside it per 256:
    x is rounded both ways in one call, and each part's features get the bits that
    part alone gives."""
    from tests.unit.models.test_packed_linear import rounded_rows_product

    parts, layer = fused_interleaved([T.Q4_K, T.Q8_0, T.Q6_K], (32, 16, 16))
    assert isinstance(layer.interleaved, FusedInterleaved)
    assert [p.kind for p in layer.interleaved.parts] == [
        BlockType.Q4_1,
        BlockType.Q8_0,
        BlockType.Q6_16,
    ]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    alone = each_part_alone(layer, x)
    q8_0 = rounded_rows_product(x, parts[1])  # per block: not the K-quants' rounding
    atol = 1e-5 * q8_0.abs().max().item()
    torch.testing.assert_close(alone[1].double(), q8_0, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_a_fused_projection_of_mixed_layouts_keeps_each_parts_file_layout(rows: int) -> None:
    """On the float32 kernels, a Q4_K query and key beside a Q6_K value stay part by
    part in the file's layout, each lean (not one Q8_16 with float32 scales and mins:
    12 bits a weight): each output feature the bits its part alone gives."""
    kinds, sizes = [T.Q4_K, T.Q4_K, T.Q6_K], (64, 32, 32)
    parts = [
        to_packed(t, random_blocks(t, n, 512, seed=n)) for t, n in zip(kinds, sizes, strict=True)
    ]
    assert all(p is not None for p in parts)
    kernel = quantized_linear_kernel()
    layer = Linear(512, 128, bias=False)
    drop_float(layer)
    layer.attach_parts(parts, kernel)
    held = layer.packed
    assert isinstance(held, FusedPacked) and layer.interleaved is None
    assert all(p.is_lean for p in held.parts)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    alone = [kernel(x, part) for part in parts]
    assert torch.equal(layer(x), torch.cat(alone, dim=1))
    assert torch.equal(held.dequantize(), PackedWeight.stack(parts).dequantize())


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_0, T.Q5_1, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_interleaving_in_pieces_gives_the_whole_matrixs_layout(
    kind: gguf.GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large matrix (a head) is interleaved some rows at a time; the pieces make the
    layout interleaving it whole makes, and it holds every block."""
    packed = to_packed(kind, random_blocks(kind, 48, 512, seed=int(kind)))
    assert packed is not None
    whole = Interleaved.of(packed)
    monkeypatch.setattr(packed_linear, "INTERLEAVE_ROWS", 16)
    pieces = Interleaved.of(packed)
    assert whole is not None and pieces is not None
    for name in ("quants", "scales", "extra"):
        a, b = getattr(whole, name), getattr(pieces, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    back = pieces.deinterleave()
    assert torch.equal(back.quants, packed.quants) and torch.equal(back.scales, packed.scales)


@pytest.mark.parametrize(
    ("kind", "bits"), [(T.Q4_K, 4.5), (T.Q5_K, 5.5), (T.Q6_K, 6.5625)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("int8_dots", [False, True], ids=["float", "int8"])
def test_a_lean_k_quant_keeps_only_its_own_scales_and_computes_the_same_bits(
    kind: gguf.GGMLQuantizationType, bits: float, int8_dots: bool
) -> None:
    """Held in the file's layout, a K-quant matrix keeps its file's d, dmin, sc and m
    in the file's bits (Q4_K in its 4.5 bits a weight, not 6; Q6_K in its 6.5625, not
    8); the kernels make the float32 scales and mins from them as they read them: the
    same floats, so the same bits as the float32 scales give, on the few-rows path and
    the strips', and the same rows looked up."""
    n, k = 40, 768
    packed = to_packed(kind, random_blocks(kind, n, k, seed=int(kind) + 40))
    assert packed is not None and packed.k_scales is not None
    floats, lean = without_k_scales(packed), packed.lean()
    assert floats is not None and lean.is_lean and lean.scales is None and lean.mins is None
    assert lean.k_scales is not None
    held = (lean.quants, lean.k_scales.supers, lean.k_scales.factors)
    assert sum(t.numel() * t.element_size() for t in held) * 8 == n * k * bits
    assert torch.equal(lean.dequantize(), packed.dequantize())
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(lean.rows(ids), packed.rows(ids))
    kernel = quantized_linear_kernel(int8_dots=int8_dots)
    for rows in (1, 3, 8, 20):  # more than 8: the strips (exact, int8 or not)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(kernel(x, lean), kernel(x, floats)), rows


def test_lean_blocks_the_kernels_cannot_read_are_refused() -> None:
    packed = to_packed(T.Q6_K, random_blocks(T.Q6_K, 16, 256, seed=5))
    assert packed is not None and packed.k_scales is not None
    lean = packed.lean()
    kernel = quantized_linear_kernel()
    x = torch.randn(1, 256)
    supers, factors = lean.k_scales.supers, lean.k_scales.factors
    with pytest.raises(ValueError, match="supers"):
        kernel(x, replace(lean, k_scales=KScales(supers[:, :0], factors)))
    with pytest.raises(ValueError, match="factors"):
        kernel(x, replace(lean, k_scales=KScales(supers, factors[:, :1])))
    with pytest.raises(ValueError, match="need a K-quant's own"):
        kernel(x, replace(lean, k_scales=None))
    q4 = to_packed(T.Q4_K, random_blocks(T.Q4_K, 16, 256, seed=6))
    assert q4 is not None and q4.k_scales is not None
    wrong = KScales(q4.k_scales.supers * 2, q4.k_scales.factors)
    with pytest.raises(ValueError, match="do not make the blocks"):
        replace(q4, k_scales=wrong).lean()
    stacked = PackedWeight.stack([q4, packed])  # Q8_16 with mins: no K-quant's own scales
    assert stacked.lean() is stacked


def test_k_quant_scales_that_do_not_make_the_blocks_are_refused() -> None:
    packed = to_packed(T.Q4_K, random_blocks(T.Q4_K, 16, 256, seed=3))
    assert packed is not None and packed.k_scales is not None
    wrong = KScales(packed.k_scales.supers * 2, packed.k_scales.factors)
    with pytest.raises(ValueError, match="do not make the blocks"):
        Interleaved.of(replace(packed, k_scales=wrong))
    compact = Interleaved.of(packed)
    assert compact is not None
    with pytest.raises(ValueError, match="extra"):
        check_interleaved(replace(compact, extra=compact.extra[:, :0]))
    with pytest.raises(ValueError, match="scales"):
        check_interleaved(replace(compact, scales=compact.scales.float()))


def test_a_k_quants_scales_round_trip_through_the_blocks_file(tmp_path: Path) -> None:
    packed = to_packed(T.Q5_K, random_blocks(T.Q5_K, 16, 512, seed=4))
    assert packed is not None and packed.k_scales is not None
    save_packed({"w": packed}, tmp_path / "w.safetensors")
    loaded = BlocksFile(tmp_path / "w.safetensors")["w"]
    assert loaded.k_scales is not None
    assert torch.equal(loaded.k_scales.supers, packed.k_scales.supers)
    assert torch.equal(loaded.k_scales.factors, packed.k_scales.factors)


def test_a_type_without_a_layout_is_left_to_float32() -> None:
    assert to_packed(T.Q2_K, random_blocks(T.Q2_K, 4, 256, seed=1)) is None


# Q4_K_M's mix, as llama-quantize writes it: most matrices Q4_K, some Q6_K (the
# output, V and down projections), here also Q5_K and Q8_0 for coverage.
K_QUANT_MIX = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q4_K,
    "attn_v": T.Q6_K,
    "attn_output": T.Q5_K,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q4_K,
    "ffn_down": T.Q6_K,
    "token_embd": T.Q8_0,
    "output": T.Q6_K,
}
# Its second layer as llama-quantize writes a Q4_K_M whose rows are not whole
# super-blocks (SmolLM2's 576): Q5_0 in their place, a Q8_0 value beside them.
FALLBACK_LAYER = {
    "attn_q": T.Q5_0,
    "attn_k": T.Q5_0,
    "attn_v": T.Q8_0,
    "ffn_gate": T.Q5_0,
    "ffn_up": T.Q5_0,
}


def k_quant_model(folder: Path, smollm_folder: Path) -> Path:
    """A tiny Llama (hidden 256: the K-quants' super-blocks) written as a GGUF of
    random K-quant blocks, then laid out as carpool's conversion lays it out (the
    tokenizer copied: this file has none)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=tiny_models.VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    path = folder / "tiny-k.gguf"
    folder.mkdir(parents=True)
    writer = gguf_writer(path, "llama", cfg)
    shapes = {
        "token_embd": (cfg.vocab_size, 256),
        "output": (cfg.vocab_size, 256),
        "attn_q": (256, 256),
        "attn_k": (128, 256),
        "attn_v": (128, 256),
        "attn_output": (256, 256),
        "ffn_gate": (512, 256),
        "ffn_up": (512, 256),
        "ffn_down": (256, 512),
    }
    seed = 0
    for layer in range(cfg.num_hidden_layers):
        for part in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{part}.weight", np.ones(256, np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            n, k = shapes[part]
            seed += 1
            kind = (FALLBACK_LAYER if layer == 1 else {}).get(part, K_QUANT_MIX[part])
            raw = random_blocks(kind, n, k, seed)
            writer.add_tensor(
                f"blk.{layer}.{part}.weight", raw, raw_shape=raw.shape, raw_dtype=kind
            )
    for name in ("token_embd", "output"):
        n, k = shapes[name]
        raw = random_blocks(K_QUANT_MIX[name], n, k, seed=100 + len(name))
        writer.add_tensor(f"{name}.weight", raw, raw_shape=raw.shape, raw_dtype=K_QUANT_MIX[name])
    writer.add_tensor("output_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    return lay_out_converted(path, folder / "converted", smollm_folder)


def lay_out_converted(path: Path, converted: Path, tokenizer_dir: Path) -> Path:
    """``path`` laid out as carpool's conversion lays a GGUF out, with the
    tokenizer of ``tokenizer_dir`` (a test's GGUF has none)."""
    converted.mkdir()
    save_converted(path, converted, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, converted / name)
    return converted


def float_bytes(lm: LoadedLM) -> int:
    return sum(p.numel() * p.element_size() for p in lm.model.parameters())


def test_a_k_quant_model_runs_on_its_blocks_with_its_float32_tokens(
    tmp_path: Path, smollm_folder: Path
) -> None:
    folder = k_quant_model(tmp_path / "k", smollm_folder)
    packed = GGUFCheckpoint(tmp_path / "k" / "tiny-k.gguf").packed_weights()
    layouts = {w.kind for w in packed.values()}
    assert layouts == {
        BlockType.Q4_1,
        BlockType.Q5_1,
        BlockType.Q5_0,
        BlockType.Q6_16,
        BlockType.Q8_0,
    }
    native = load_causal_lm(folder, progress=False, weight_kernel="native")
    plain = load_causal_lm(folder, progress=False, weight_kernel="torch")
    assert native.packed_layers == 4 * 2 + 1  # qkv, o, gate_up, down per layer; the head
    assert native.model.stack is not None  # the fused stack runs K-quant layers too
    first, fallback = native.model.layers
    # a fused projection whose parts differ keeps each part in its own layout: Q5_0
    # query and key beside a Q8_0 value, Q4_K beside Q6_K
    second_qkv, first_qkv = fallback.self_attn.qkv_proj.packed, first.self_attn.qkv_proj.packed
    assert isinstance(second_qkv, FusedPacked) and isinstance(first_qkv, FusedPacked)
    assert [p.kind for p in second_qkv.parts] == [BlockType.Q5_0, BlockType.Q5_0, BlockType.Q8_0]
    assert [(p.kind, p.is_lean) for p in first_qkv.parts] == [
        (BlockType.Q4_1, True),
        (BlockType.Q4_1, True),
        (BlockType.Q6_16, True),
    ]
    assert fallback.mlp.gate_up_proj.packed.kind is BlockType.Q5_0
    # Q4_K, Q5_K and Q6_K matrices keep only their own scales
    lean = [first.mlp.gate_up_proj, first.self_attn.o_proj, first.mlp.down_proj]
    assert all(linear.packed.is_lean for linear in [*lean, native.model.lm_head])
    # The blocks alone hold the matrices and the embedding table: the float32
    # parameters left are the norms.
    assert float_bytes(native) == 4 * 256 * (2 * 2 + 1)
    assert float_bytes(plain) > 100 * float_bytes(native)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (1, 9, 60)]
    expected = generate(plain, prompts, 16)
    assert generate(native, prompts, 16) == expected
    assert generate(native, prompts, 16, max_num_batched_tokens=32) == expected
    native.model.stack = None  # layer by layer: the few-rows kernels and the strips
    assert generate(native, prompts, 16, max_num_batched_tokens=32) == expected


def test_auto_runs_a_k_quant_file_as_llama_cpp_does_and_other_files_exactly(
    tmp_path: Path, smollm_folder: Path
) -> None:
    """``auto`` gives a K-quant file (Q4_K_M) int8 dot products where the interleaved
    kernel has its vector code, as llama.cpp runs the files it makes, and says so in
    the path taken; the built-in Q4_1 file (no K-quants) runs exact."""
    vectorized = quantized_linear_kernel(int8_dots=True).interleaved_vectorized > 0
    folder = k_quant_model(tmp_path / "k", smollm_folder)
    auto = load_causal_lm(folder, progress=False, weight_kernel="auto")
    kernel = auto.model.lm_head.kernel
    assert kernel is not None and kernel.int8_dots == vectorized
    assert ("auto: a K-quant file" in auto.paths[0].detail) == vectorized
    builtin = load_causal_lm(smollm_folder, progress=False, weight_kernel="auto")
    assert builtin.model.lm_head.kernel is not None
    assert not builtin.model.lm_head.kernel.int8_dots
    assert "int8" not in builtin.paths[0].detail


def test_int8_dots_keep_each_interleaved_matrix_once_and_run_it_fused(
    tmp_path: Path, smollm_folder: Path
) -> None:
    """With ``native-int8`` on a CPU with the interleaved kernel's vector code, every
    matrix keeps its interleaved copy alone (not the file's beside it), a fused
    projection of mixed layouts part by part; the fused stack, which then has no
    file-layout pointer for those matrices, gives the log-probabilities layer-by-layer
    steps give (to what an int8 rounding moved by a last bit changes: 0.02 seen)."""
    folder = k_quant_model(tmp_path / "k", smollm_folder)
    int8 = load_causal_lm(folder, progress=False, weight_kernel="native-int8")
    kernel = int8.model.lm_head.kernel
    if kernel is None or not kernel.interleaved_vectorized:
        pytest.skip("no AVX2: int8 dot products run on the file's blocks")
    kinds = set()
    k_scaled = set()
    for layer in int8.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert linear.packed is None and linear.interleaved is not None
            parts = interleaved_parts(linear.interleaved)
            kinds |= {p.kind for p in parts}
            if all(p.k_scales for p in parts):
                k_scaled.add(linear)
    # the first layer's Q4_K gate and up (fused) and q/k/v (Q4_K, Q6_K, part by part),
    # each layer's Q5_K output and Q6_K down, and the Q6_K head keep the file's own scales
    first, second = int8.model.layers
    assert k_scaled == {
        first.self_attn.qkv_proj,
        first.mlp.gate_up_proj,
        first.self_attn.o_proj,
        second.self_attn.o_proj,
        first.mlp.down_proj,
        second.mlp.down_proj,
    }
    assert isinstance(first.self_attn.qkv_proj.interleaved, FusedInterleaved)
    # the second's Q5_0 query and key keep their 6 bits beside its Q8_0 value
    second_qkv = second.self_attn.qkv_proj.interleaved
    assert [p.kind for p in interleaved_parts(second_qkv)] == [
        BlockType.Q5_0,
        BlockType.Q5_0,
        BlockType.Q8_0,
    ]
    assert int8.model.lm_head.interleaved is not None and int8.model.lm_head.interleaved.k_scales
    assert kinds == set(BlockType) - {BlockType.Q8_16}  # every file's layout
    assert int8.model.stack is not None
    rng = random.Random(8)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (2, 9, 60)]
    sequences = [p + t for p, t in zip(prompts, generate(int8, prompts, 16), strict=True)]
    fused = prompt_logprobs(int8, sequences)
    int8.model.stack = None
    # The two paths sum some floats in other orders (torch's kernels per instruction
    # set): a last bit can move an int8 rounding, so each token's log-probability is
    # compared, given the same tokens before it, not the greedy tokens themselves.
    for got, want in zip(prompt_logprobs(int8, sequences), fused, strict=True):
        np.testing.assert_allclose(got, want, atol=0.1)


def prompt_logprobs(lm: LoadedLM, sequences: list[list[int]]) -> list[list[float]]:
    """Each token's log-probability given the ones before it (prefilled 32 at a time)."""
    eng = engine_for(lm, EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=32))
    for i, sequence in enumerate(sequences):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        eng.add_request(str(i), sequence, params)
    done: dict[str, list[float]] = {}
    while eng.has_work:
        for out in eng.step():
            if out.finished:
                assert out.prompt_logprobs is not None
                done[out.request_id] = [e.logprob for e in out.prompt_logprobs[1:] if e is not None]
    return [done[str(i)] for i in range(len(sequences))]
