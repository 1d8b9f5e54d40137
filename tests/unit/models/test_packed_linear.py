"""Linear layers on a GGUF file's blocks: the blocks hold exactly the float32
weights the file defines, the kernel computes the float32 product from them, a
layer uses them only for few rows, and the setting takes effect."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize, quantize

from carpool.config import EngineConfig
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.models.gguf_blocks import to_packed
from carpool.models.packed_linear import (
    MAX_KERNEL_ROWS,
    PER_16,
    BlocksFile,
    BlockType,
    Interleaved,
    Linear,
    PackedWeight,
    pack_k_scales,
    quantized_linear_kernel,
    save_packed,
    six_bit_lanes,
    six_bit_pairs,
    unpack_k_scales,
)
from carpool.workers.factory import engine_for
from tests import tiny_models
from tests.unit.models.test_weights import _mapped_resident

# The file type each layout is made from here.
KINDS = {
    BlockType.Q4_1: GGMLQuantizationType.Q4_1,
    BlockType.Q8_0: GGMLQuantizationType.Q8_0,
    BlockType.Q5_1: GGMLQuantizationType.Q5_1,
    BlockType.Q5_0: GGMLQuantizationType.Q5_0,
}
# Each layout the kernels read; Q8_16 (a mixed fused projection's) with and without
# mins; Q6_16 (Q6_K's 6 bits).
LAYOUTS = ["Q4_1", "Q8_0", "Q5_1", "Q5_0", "Q8_16", "Q8_16+mins", "Q6_16"]
INTERLEAVED = ["Q4_1", "Q8_0", "Q5_1", "Q5_0"]  # Q6_16 is interleaved only with Q6_K's scales


def gguf_weight(
    kind: BlockType | str, n: int, k: int, seed: int = 0
) -> tuple[PackedWeight, torch.Tensor]:
    """Blocks of ``kind`` (a layout name of ``LAYOUTS``), and the float32 weight they
    hold: Q4_1, Q5_1, Q5_0 and Q8_0 made by the gguf package (and read as it reads them);
    Q8_16 and Q6_16 random quants of 6 bits with scales (and Q8_16's mins) per 16, as
    a Q6_K's (a Q5_K's) unpack to (``test_gguf_blocks.py`` checks the unpacking
    against gguf)."""
    if kind in ("Q8_16", "Q8_16+mins", "Q6_16"):
        gen = torch.Generator().manual_seed(seed)
        quants = torch.randint(-32, 32, (n, k // 32, 32), generator=gen, dtype=torch.int8)
        scales = torch.rand(n, k // 16, generator=gen) * 0.004
        mins = -torch.rand(n, k // 16, generator=gen) * 0.05 if kind == "Q8_16+mins" else None
        if kind == "Q6_16":
            packed = PackedWeight(BlockType.Q6_16, six_bit_lanes(quants), scales, None)
            assert torch.equal(packed.signed_quants(), quants)
        else:
            packed = PackedWeight(BlockType.Q8_16, quants, scales, mins)
        return packed, packed.dequantize()
    data = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    file_type = KINDS[BlockType(kind)]  # made by the gguf package, read by gguf_blocks
    raw = quantize(data, file_type)
    weight = torch.from_numpy(np.array(dequantize(raw, file_type), dtype=np.float32))
    packed = to_packed(file_type, raw)
    assert packed is not None and packed.kind is BlockType(kind)
    return packed, weight.reshape(n, k)


@pytest.mark.parametrize("kind", INTERLEAVED)
def test_blocks_hold_the_weights_the_file_defines(kind: str) -> None:
    packed, weight = gguf_weight(kind, 40, 96)
    assert packed.shape == (40, 96)
    assert torch.equal(packed.dequantize(), weight)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 17, 40, MAX_KERNEL_ROWS])
def test_the_kernel_computes_the_float32_product(kind: str, rows: int) -> None:
    packed, weight = gguf_weight(kind, 70, 160, seed=rows)  # 70: a partial strip of 6
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    out = quantized_linear_kernel()(x, packed)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_past_a_few_rows_a_rows_bits_do_not_depend_on_the_batch(kind: str) -> None:
    """Steps of more than a few rows go through dequantized strips; each output
    still sums over k in order, so a row gets the same bits in any batch."""
    packed, _ = gguf_weight(kind, 64, 96, seed=4)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    kernel = quantized_linear_kernel()
    whole = kernel(x, packed)
    assert torch.equal(kernel(x[5:22], packed), whole[5:22])
    assert torch.equal(kernel(x[20:40], packed), whole[20:40])


@pytest.mark.parametrize("int8_dots", [False, True])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_row_alone_gets_the_bits_it_gets_among_a_few(kind: str, int8_dots: bool) -> None:
    """A one-row step (one stream decoding) runs every layout four features at a
    time; each feature's sums keep the few-rows kernel's order, so a stream's logits
    do not depend on whether others share its step. 70 features: groups of four and
    a remainder in the last chunk of 16."""
    packed, _ = gguf_weight(kind, 70, 160, seed=11)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(11))
    kernel = quantized_linear_kernel(int8_dots)
    together = kernel(x, packed)
    for r in range(3):
        assert torch.equal(kernel(x[r : r + 1], packed)[0], together[r])


def test_a_layer_uses_its_blocks_for_few_rows_only() -> None:
    packed, weight = gguf_weight(BlockType.Q4_1, 64, 128)
    layer = Linear(128, 64, bias=True)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.attach(packed, quantized_linear_kernel())
    kernel = quantized_linear_kernel()
    few = torch.randn(MAX_KERNEL_ROWS, 128)
    many = torch.randn(MAX_KERNEL_ROWS + 1, 128)
    with torch.no_grad():
        assert torch.equal(layer(few), kernel(few, packed) + layer.bias)
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


def test_a_layer_refuses_blocks_of_another_weight() -> None:
    packed, weight = gguf_weight(BlockType.Q8_0, 32, 64)
    layer = Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight * 1.001)
    with pytest.raises(ValueError, match="do not hold this layer's float32 weight"):
        layer.attach(packed, quantized_linear_kernel())
    with pytest.raises(ValueError, match="packed"):
        Linear(32, 32).attach(packed, quantized_linear_kernel())


def test_blocks_round_trip_through_their_file(tmp_path: Path) -> None:
    weights = {
        "a": gguf_weight(BlockType.Q4_1, 8, 64)[0],
        "b": gguf_weight(BlockType.Q8_0, 4, 32)[0],
    }
    save_packed(weights, tmp_path / "blocks" / "w.safetensors")
    loaded = BlocksFile(tmp_path / "blocks" / "w.safetensors")
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():
        assert loaded[name].kind is w.kind
        assert torch.equal(loaded[name].dequantize(), w.dequantize())


def test_a_blocks_file_reads_each_weight_when_asked_and_keeps_no_map(tmp_path: Path) -> None:
    weights = {
        "a": gguf_weight(BlockType.Q4_1, 8, 64)[0],
        "b": gguf_weight(BlockType.Q8_0, 4, 32)[0],
    }
    path = tmp_path / "w.safetensors"
    save_packed(weights, path)
    blocks = BlocksFile(path)
    assert set(blocks) == {"a", "b"} and len(blocks) == 2
    a = blocks["a"]
    assert a.kind is BlockType.Q4_1 and torch.equal(a.dequantize(), weights["a"].dequantize())
    assert _mapped_resident(path) == 0  # copied out of a map that is closed again
    del blocks["a"]
    assert "a" not in blocks and list(blocks) == ["b"]
    with pytest.raises(TypeError):
        blocks["c"] = a


def test_a_model_takes_each_block_matrix_once_from_its_file(
    smollm_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading reads each of the blocks file's matrices once, as its layer takes it (the
    tied embedding and head share one read), and holds none of the file after; the
    embedding looks its rows up in the kernel."""
    reads: list[str] = []
    real = BlocksFile.__getitem__

    def counted(self: BlocksFile, name: str) -> PackedWeight:
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(BlocksFile, "__getitem__", counted)
    lm = load_causal_lm(smollm_folder, progress=False, weight_kernel="native")
    assert lm.packed_layers == 4 * lm.config.num_layers + 1
    assert len(reads) == len(set(reads)) == 7 * lm.config.num_layers + 1
    embed = lm.model.embed_tokens
    assert embed.packed is not None  # the tied head's blocks
    ids = torch.tensor([[5, 99], [4000, 5]])  # looked up in C: the floats torch makes
    assert embed.kernel is not None and torch.equal(embed(ids), embed.packed.rows(ids))


def test_the_builtin_model_runs_its_blocks_and_keeps_its_outputs(
    smollm: LoadedLM, smollm_folder: Path
) -> None:
    """The built-in model is Q4_1 with a Q8_0 embedding: every linear layer gets its
    blocks (4 per layer and the tied head), and one stream, which decodes on them,
    gets the greedy tokens the float32 GEMM gives."""
    assert smollm.packed_layers == 4 * smollm.config.num_layers + 1
    plain = load_causal_lm(smollm_folder, progress=False, weight_kernel="torch")
    assert plain.packed_layers == 0
    head = smollm.model.lm_head
    assert isinstance(head, Linear) and head.kernel is not None
    real, rows = head.kernel, []

    def counting(
        x: torch.Tensor, weight: PackedWeight, interleaved: Interleaved | None = None
    ) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, weight, interleaved)

    head.kernel = counting  # type: ignore[assignment]
    try:
        prompt = smollm.tokenizer.encode("The three primary colours are")
        tokens = [alone(lm, prompt) for lm in (smollm, plain)]
    finally:
        head.kernel = real
    assert rows and max(rows) <= MAX_KERNEL_ROWS
    assert tokens[0] == tokens[1]


def alone(lm: LoadedLM, prompt: list[int]) -> list[int]:
    engine = engine_for(lm, EngineConfig(kv_cache_memory="64MiB"))
    engine.add_request("x", prompt, SamplingParams(max_tokens=24, temperature=0.0))
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no final output")


def test_native_weights_are_refused_where_there_are_no_blocks(
    tmp_path: Path, smollm_folder: Path
) -> None:
    folder = tmp_path / "tiny"
    tiny_models.build("llama", folder, smollm_folder)
    with pytest.raises(ValueError, match="weight_kernel native cannot be used: the model has no"):
        load_causal_lm(folder, progress=False, weight_kernel="native")
    assert load_causal_lm(folder, progress=False).packed_layers == 0


def rounded_rows_product(
    x: torch.Tensor, packed: PackedWeight, super_blocks: bool = False
) -> torch.Tensor:
    """What int8 dot products compute, in float64: each block of 32 of x rounded to
    steps of its amax / 127, times the blocks' integer quants and both scales; the
    mins times the float32 sum of x's elements they apply to (Q8_16: per 16).
    ``super_blocks``: as the interleaved Q4_K and Q5_K tiles compute, one step for each
    256 of x (its 8 blocks' largest), and the mins times the rounded sums."""
    blocks = x.view(x.shape[0], -1, 32)
    step = blocks.abs().amax(-1) / 127
    if super_blocks:
        step = step.view(x.shape[0], -1, 8).amax(-1).repeat_interleave(8, dim=-1)
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    xq = torch.round(blocks * inverse[..., None]).double()
    if packed.kind in (BlockType.Q5_0, BlockType.Q6_16):
        q = packed.signed_quants().double()
    elif packed.kind in (BlockType.Q4_1, BlockType.Q5_1):
        q = packed.integer_quants().double()
    else:
        q = packed.quants.double()
    per = 16 if packed.kind in PER_16 else 32
    rows, n = x.shape[0], q.shape[0]
    dots = torch.einsum("rgj,ngj->rng", xq.view(rows, -1, per), q.view(n, -1, per))
    steps = step.double().repeat_interleave(32 // per, dim=-1)
    y = (dots * packed.scales.double()[None] * steps[:, None, :]).sum(-1)
    if packed.mins is not None:
        sums = x.view(rows, -1, per).sum(-1).double()
        if super_blocks:
            sums = xq.view(rows, -1, per).sum(-1) * steps
        y += (sums[:, None, :] * packed.mins.double()[None]).sum(-1)
    return y


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize(
    ("n", "rows"), [(70, 1), (70, 3), (70, 5), (70, 8), (80, 1), (80, 3), (80, 9), (80, 40)]
)
def test_int8_dots_are_integer_products_of_the_rounded_rows(kind: str, n: int, rows: int) -> None:
    """70 features are not interleaved: steps of up to 8 rows run the few-rows int8
    kernel; 80 are (Q4_1, Q8_0, Q5_1, Q5_0): every row count runs the interleaved kernel. The same
    arithmetic, up to the order of float32 sums."""
    if kind not in INTERLEAVED and rows > 8:
        pytest.skip(f"{kind} is not interleaved: more than 8 rows stay exact")
    packed, weight = gguf_weight(kind, n, 160, seed=rows)
    interleaved = Interleaved.of(packed)
    assert (interleaved is None) == (n % 16 != 0 or kind not in INTERLEAVED)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)) * 4
    x[0, 32:64] = 0.0  # an all-zero block: step 0
    x[-1, 64] = 1e4  # one large element: the rest of its block rounds to few steps
    out = quantized_linear_kernel(int8_dots=True)(x, packed, interleaved).double()
    expected = rounded_rows_product(x, packed)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    exact = (x @ weight.T).double()
    assert not torch.allclose(out, exact, rtol=1e-5, atol=1e-5)  # it did round
    assert (out - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("kind", LAYOUTS)
def test_int8_dots_leave_steps_of_more_than_8_rows_exact_without_interleaving(
    kind: str,
) -> None:
    packed, _ = gguf_weight(kind, 70, 96, seed=9)  # 70 rows: not interleaved
    assert Interleaved.of(packed) is None
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(9))
    exact = quantized_linear_kernel()(x, packed)
    assert torch.equal(quantized_linear_kernel(int8_dots=True)(x, packed), exact)


@pytest.mark.parametrize("kind", INTERLEAVED)
def test_interleaving_keeps_every_block(kind: str) -> None:
    """In the file's bits: its float16 scales and mins (Q8_0: an int16 sum a block)."""
    packed, _ = gguf_weight(kind, 48, 96, seed=3)
    interleaved = Interleaved.of(packed)
    assert interleaved is not None
    held = sum(
        t.numel() * t.element_size()
        for t in (interleaved.scales, interleaved.extra)
        if t is not None
    )
    assert held == 48 * 96 // 32 * 2 * (1 if kind == "Q5_0" else 2)
    back = interleaved.deinterleave()
    assert torch.equal(back.quants, packed.quants)
    assert torch.equal(back.scales, packed.scales)
    assert back.mins is None if packed.mins is None else torch.equal(back.mins, packed.mins)


@pytest.mark.parametrize("kind", INTERLEAVED)
def test_an_interleaved_rows_bits_do_not_depend_on_its_step(kind: str) -> None:
    """A row computed alone, in a few rows (speculative verification) or in a prompt
    chunk gets the same bits: greedy speculation then keeps the tokens."""
    packed, _ = gguf_weight(kind, 64, 128, seed=5)
    interleaved = Interleaved.of(packed)
    kernel = quantized_linear_kernel(int8_dots=True)
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(5))
    together = kernel(x, packed, interleaved)
    for r in (0, 7, 8, 20):
        assert torch.equal(kernel(x[r : r + 1], packed, interleaved)[0], together[r])
    assert torch.equal(kernel(x[3:9], packed, interleaved), together[3:9])


def test_interleaved_blocks_are_checked_before_the_call() -> None:
    packed, _ = gguf_weight(BlockType.Q4_1, 32, 64, seed=1)
    interleaved = Interleaved.of(packed)
    assert interleaved is not None
    kernel, x = quantized_linear_kernel(int8_dots=True), torch.randn(2, 64)
    broken = Interleaved(
        interleaved.kind,
        interleaved.quants[:1],
        interleaved.scales,
        interleaved.extra,
        interleaved.shape,
    )
    with pytest.raises(ValueError, match="quants"):
        kernel(x, packed, broken)
    other = Interleaved.of(gguf_weight(BlockType.Q4_1, 48, 64, seed=1)[0])
    with pytest.raises(ValueError, match="not this weight's"):
        kernel(x, packed, other)


def test_int8_dots_keep_the_builtin_models_text_likelihood(
    smollm: LoadedLM, smollm_folder: Path
) -> None:
    """``native-int8`` runs the fused stack and the head with int8 dot products (every
    row of every step): each token's log-likelihood of a fixed text moves, a little,
    and the perplexity stays within 5% (a text of ~130 tokens; on 40 it moved 5.3%
    once; BENCHMARKS.md has it on a longer text)."""
    int8 = load_causal_lm(smollm_folder, progress=False, weight_kernel="native-int8")
    assert "int8" in int8.paths[0].detail
    text = (
        "The river rises in the hills above the town and runs south through farmland "
        "for forty miles before it reaches the sea. In spring the snow melts and the "
        "water comes down fast and brown; by late summer it is slow and clear. The "
        "old mill by the bridge ground corn for two hundred years; it is a museum now, "
        "and children come by the busload to watch the wheel turn. Below the mill the "
        "valley widens, the road follows the water, and the villages grow larger until "
        "the river meets the tide at the harbour, where fishing boats still land their "
        "catch each morning before the market opens."
    )
    prompt = smollm.tokenizer.encode(text)
    floats, ints = (prompt_logprobs(lm, prompt) for lm in (smollm, int8))
    moved = np.abs(np.array(ints) - np.array(floats))
    assert moved.max() > 0  # the int8 path ran
    assert moved.mean() < 0.3  # 0.14 nats here
    assert abs(np.exp(np.mean(floats) - np.mean(ints)) - 1) < 0.05  # perplexity: +1.8% here


def test_a_tied_embedding_looks_its_rows_up_in_the_heads_interleaved_copy(
    smollm: LoadedLM, smollm_folder: Path
) -> None:
    """With ``native-int8`` the built-in model's tied head keeps its table interleaved;
    the embedding reads its rows there (one copy of ~30 MiB, not two), the same floats
    the file's blocks give, whichever strips the ids fall in."""
    int8 = load_causal_lm(smollm_folder, progress=False, weight_kernel="native-int8")
    embedding, head = int8.model.embed_tokens, int8.model.lm_head
    if head.interleaved is None:
        pytest.skip("no AVX2: nothing is interleaved")
    assert embedding.interleaved is head.interleaved and embedding.packed is None
    file_blocks = smollm.model.embed_tokens
    ids = torch.tensor([[0, 17, 16, 49151], [5, 5, 40000, 31]])
    assert file_blocks.packed is not None
    assert torch.equal(embedding(ids), file_blocks.packed.rows(ids))


def prompt_logprobs(lm: LoadedLM, prompt: list[int]) -> list[float]:
    """Each prompt token's log-probability (but the first's), prefilled 8 rows at a time."""
    engine = engine_for(lm, EngineConfig(kv_cache_memory="64MiB", max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine.add_request("x", prompt, params)
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                entries = out.prompt_logprobs[1:]
                return [entry.logprob for entry in entries]
    raise AssertionError("no final output")


def test_a_fused_projection_of_mixed_layouts_keeps_every_weight() -> None:
    """A Q4_K_M file's Q4_K query and key beside its Q6_K value: one Q8_16 matrix."""
    parts = [gguf_weight(kind, 16, 64, seed=i) for i, kind in enumerate(LAYOUTS)]
    fused = PackedWeight.stack([p for p, _ in parts])
    assert fused.kind is BlockType.Q8_16
    assert torch.equal(fused.dequantize(), torch.cat([w for _, w in parts]))
    same = PackedWeight.stack([parts[0][0], parts[0][0]])
    assert same.kind is BlockType.Q4_1


def test_q5_0_beside_q8_0_is_fused_as_q8_0() -> None:
    """The Q5_0 query and key beside a Q8_0 value (llama-quantize's fallback where
    rows are not whole K-quant super-blocks): Q8_0, 9 bits a weight, not Q8_16's 12."""
    parts = [gguf_weight(kind, 16, 64, seed=i) for i, kind in enumerate(["Q5_0", "Q5_0", "Q8_0"])]
    fused = PackedWeight.stack([p for p, _ in parts])
    assert fused.kind is BlockType.Q8_0 and fused.mins is None
    assert torch.equal(fused.dequantize(), torch.cat([w for _, w in parts]))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    product = x @ torch.cat([w for _, w in parts]).T
    torch.testing.assert_close(quantized_linear_kernel()(x, fused), product, rtol=1e-5, atol=1e-5)


def test_q4_k_scales_and_mins_are_interleaved_in_their_files_six_bits() -> None:
    """A strip's sc and m (each below 64) in 6 bits, per super-block: each block's low
    nibbles, then two runs of their bits 4 and 5; a value of 64 cannot be held."""
    seeded = torch.Generator().manual_seed(5)
    pairs = torch.randint(0, 64, (3, 16, 2, 16), dtype=torch.uint8, generator=seeded)
    packed = six_bit_pairs(pairs)
    assert packed.shape == (3, 2, 192) and packed.dtype == torch.uint8
    sc, m = int(pairs[2, 8 + 5, 0, 7]), int(pairs[2, 8 + 5, 1, 7])  # super-block 1, block 5
    assert int(packed[2, 1, 16 * 5 + 7]) == (sc & 15) | (m & 15) << 4
    run = packed[2, 1, 128 + 32 * (5 // 4) :]  # bits 4-5 of block 5 at bits 2, 3
    assert (int(run[7]) >> 2) & 3 == sc >> 4 and (int(run[16 + 7]) >> 2) & 3 == m >> 4
    with pytest.raises(ValueError, match="6 bits"):
        six_bit_pairs(torch.full((1, 8, 2, 16), 64, dtype=torch.uint8))


def test_q4_k_scales_and_mins_are_held_in_their_files_twelve_bytes() -> None:
    """The file layout holds any 12 bytes: each super-block's sc and m unpack to the
    values the gguf package reads from them, and pack back to the same bytes; a value
    of 64 cannot be held."""
    seeded = torch.Generator().manual_seed(6)
    file_bytes = torch.randint(0, 256, (3, 4, 12), dtype=torch.uint8, generator=seeded)
    pairs = unpack_k_scales(file_bytes)
    assert pairs.shape == (3, 32, 2) and pairs.dtype == torch.uint8
    sc, m = Q4_K.get_scale_min(file_bytes.numpy().reshape(-1, 12))
    assert np.array_equal(pairs[..., 0].numpy().reshape(-1, 8), sc.reshape(-1, 8))
    assert np.array_equal(pairs[..., 1].numpy().reshape(-1, 8), m.reshape(-1, 8))
    assert torch.equal(pack_k_scales(pairs), file_bytes)
    with pytest.raises(ValueError, match="6 bits"):
        pack_k_scales(torch.full((1, 8, 2), 64, dtype=torch.uint8))
