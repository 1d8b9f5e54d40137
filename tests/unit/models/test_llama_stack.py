"""The fused stack: an engine step (decodes, prompt chunks or both) runs every
decoder layer in one native call and gives what the layer-by-layer path gives,
however the prompts are chunked or cached; it runs exactly where it applies, and
the kernel settings turn it off."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from carpool.config import EngineConfig
from carpool.engine.block_manager import HybridBlockManager
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.attention import AttentionMetadata, NativeDecode, PrefillSegment
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.models.decode_kernel import compile_decode_kernel
from carpool.models.gguf_blocks import to_packed
from carpool.models.llama import LlamaForCausalLM
from carpool.models.llama_stack import LlamaStack
from carpool.models.packed_linear import BlockType, quantized_linear_kernel
from carpool.workers.factory import engine_for
from carpool.workers.model_runner import ModelRunner
from tests import tiny_models

KINDS = {BlockType.Q4_1: GGMLQuantizationType.Q4_1, BlockType.Q8_0: GGMLQuantizationType.Q8_0}
PROMPTS = [[5 + i for i in range(n)] for n in (3, 17, 40, 9, 64)]


def tiny_with_blocks(
    arch: str,
    folder: Path,
    smollm_folder: Path,
    kind: BlockType,
    window: int | None = None,
    int8: bool = False,
) -> LoadedLM:
    """A tiny random ``arch`` model whose decoder linear weights are ``kind`` blocks
    (the float32 weights are what the blocks hold), with the blocks attached (their
    dot products in int8 where ``int8``); ``window``: a sliding window (Mistral's)."""
    tiny_models.build(arch, folder, smollm_folder, sliding_window=window)
    tensors = load_file(str(folder / "model.safetensors"))
    packed = {}
    for name, weight in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            raw = quantize(weight.numpy(), KINDS[kind])
            values = np.array(dequantize(raw, KINDS[kind]), dtype=np.float32)
            tensors[name] = torch.from_numpy(values).reshape(weight.shape)
            packed[name] = to_packed(KINDS[kind], raw)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    lm = load_causal_lm(folder, progress=False, weight_kernel="torch")
    model = lm.model
    assert isinstance(model, LlamaForCausalLM)
    kernel = quantized_linear_kernel(int8)
    assert model.attach_packed(packed, kernel) == 4 * lm.config.num_layers
    return lm


class Counting:
    """Wraps a stack and counts the rows of each step it runs."""

    def __init__(self, stack: LlamaStack) -> None:
        self.stack, self.rows = stack, list[int]()

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.stack(x, *args)


@contextmanager
def stack_replaced(lm: LoadedLM, replacement: Any) -> Iterator[Any]:
    model = lm.model
    assert isinstance(model, LlamaForCausalLM)
    kept = model.stack
    model.stack = replacement
    try:
        yield replacement
    finally:
        model.stack = kept


NEW_TOKENS = 12


def run(eng: Engine, prompts: list[list[int]], first: int = 0) -> dict[str, Any]:
    """Each prompt's finished output (greedy, top-3 logprobs), all running together."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts, start=first):
        eng.add_request(str(i), prompt, params)
    results: dict[str, Any] = {}
    while eng.has_work:
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out
    return results


def generate(lm: LoadedLM, prompts: list[list[int]], **engine: Any) -> dict[str, Any]:
    return run(
        engine_for(lm, EngineConfig(kv_cache_memory="16MiB", block_size=16, **engine)), prompts
    )


def assert_same(fused: dict[str, Any], plain: dict[str, Any], rtol: float = 1e-4) -> None:
    """The same tokens, and log-probabilities within ``rtol``."""
    assert fused.keys() == plain.keys()
    for key, request in plain.items():
        expected, got = request.outputs[0], fused[key].outputs[0]
        assert got.token_ids == expected.token_ids
        for ours, theirs in zip(got.logprobs, expected.logprobs, strict=True):
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
            np.testing.assert_allclose(
                [p for _, p in ours.top], [p for _, p in theirs.top], rtol=rtol, atol=1e-5
            )


@pytest.mark.parametrize(
    ("arch", "kind", "kv_cache_dtype"),
    [
        ("llama", BlockType.Q4_1, "auto"),
        ("llama", BlockType.Q4_1, "float16"),
        ("mistral", BlockType.Q8_0, "auto"),
        ("qwen2", BlockType.Q4_1, "auto"),  # QKV bias
        ("qwen3", BlockType.Q4_1, "auto"),  # q/k norms
    ],
)
def test_the_stack_gives_the_layer_by_layer_results(
    arch: str, kind: BlockType, kv_cache_dtype: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """Whole prompts (their keys gathered per chunk) and decodes; a float16 cache
    read back by both paths (rounding magnifies last-bit differences: see below)."""
    lm = tiny_with_blocks(arch, tmp_path / arch, smollm_folder, kind)
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    counting = Counting(model.stack)
    with stack_replaced(lm, counting):
        fused = generate(lm, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    with stack_replaced(lm, None):
        plain = generate(lm, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    # Every token of every step ran fused: the prompts, then the decodes.
    assert sum(counting.rows) == sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW_TOKENS - 1)
    assert counting.rows[0] == sum(map(len, PROMPTS)) and counting.rows[-1] == len(PROMPTS)
    assert_same(fused, plain, rtol=1e-3 if kv_cache_dtype == "float16" else 1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_chunked_and_cached_prompts_on_the_stack(
    kv_cache_dtype: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """A budget of 16 tokens chunks the prompts and mixes their chunks with the
    running decodes; a second wave reuses the first's cached prefixes. Each row
    attends up to its own position, as the layer-by-layer path attends it; with a
    float16 cache both round each key and value once and read it back."""
    lm = tiny_with_blocks("llama", tmp_path / "llama", smollm_folder, BlockType.Q8_0)
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    again = [[*p, 7, 8, 9] for p in PROMPTS if len(p) >= 16]

    def both_waves() -> dict[str, Any]:
        config = EngineConfig(
            kv_cache_memory="16MiB",
            block_size=16,
            max_num_batched_tokens=16,
            kv_cache_dtype=kv_cache_dtype,
        )
        eng = engine_for(lm, config)
        assert eng.runner.caches[0].dtype == (  # type: ignore[attr-defined]
            torch.float16 if kv_cache_dtype == "float16" else torch.float32
        )
        results = run(eng, PROMPTS)
        results.update(run(eng, again, first=len(PROMPTS)))
        return results

    counting = Counting(model.stack)
    with stack_replaced(lm, counting):
        fused = both_waves()
    with stack_replaced(lm, None):
        plain = both_waves()
    cached = sum(out.num_cached_tokens for out in fused.values())
    assert cached >= 16 * len(again)
    prompts = PROMPTS + again
    computed = sum(map(len, prompts)) - cached + len(prompts) * (NEW_TOKENS - 1)
    assert max(counting.rows) == 16 and sum(counting.rows) == computed
    # Rounding to halves magnifies the paths' last-bit differences (a key one float
    # ulp apart can round to neighbouring halves, 2^-11 apart).
    assert_same(fused, plain, rtol=1e-3 if kv_cache_dtype == "float16" else 1e-4)


@pytest.mark.parametrize(
    ("arch", "budget", "kv_cache_dtype"),
    [
        ("mistral", 32, "auto"),
        ("mistral", 8, "auto"),
        ("gemma3", 32, "auto"),
        ("gemma3", 8, "auto"),
        ("gemma3", 32, "float16"),  # both pools in halves
    ],
)
def test_a_sliding_window_on_the_stack(
    arch: str, budget: int, kv_cache_dtype: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """A window of 16 (Mistral: every layer, its blocks behind the window released;
    Gemma 3: its sliding layer, with its own rotary table, beside a global one, its
    four norms and GELU gating) under prompts of up to 64 tokens and 12 more: prompt
    chunks of 32 rows (attended together, the second starting past the window) or of
    8 (row by row), and decodes, each row within its window, as the layer-by-layer
    path attends it. Gemma 3's sliding layer keeps its KV in a pool of its own: both
    paths leave every layer's cache the same, so each wrote its pool's slots."""
    lm = tiny_with_blocks(arch, tmp_path / arch, smollm_folder, BlockType.Q8_0, 16)
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    assert 16 in lm.config.layer_windows()
    counting = Counting(model.stack)
    config = EngineConfig(
        kv_cache_memory="16MiB",
        block_size=16,
        max_num_batched_tokens=budget,
        kv_cache_dtype=kv_cache_dtype,
    )
    engines = [engine_for(lm, config), engine_for(lm, config)]
    with stack_replaced(lm, counting):
        fused = run(engines[0], PROMPTS)
    with stack_replaced(lm, None):
        plain = run(engines[1], PROMPTS)
    assert max(counting.rows) == budget
    # a half's rounding magnifies the paths' last-bit differences (see above)
    rtol = 1e-3 if kv_cache_dtype == "float16" else 1e-4
    assert_same(fused, plain, rtol=rtol)
    assert isinstance(engines[0].blocks, HybridBlockManager) == (arch == "gemma3")
    caches = [cast(ModelRunner, e.runner).caches for e in engines]
    for layer, (ours, theirs) in enumerate(zip(*caches, strict=True)):
        assert ours.dtype == (torch.float16 if kv_cache_dtype == "float16" else torch.float32)
        torch.testing.assert_close(ours, theirs, rtol=rtol, atol=1e-5, msg=f"layer {layer}")


def test_the_builtin_model_decodes_on_the_stack(smollm: LoadedLM) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    prompts = [smollm.tokenizer.encode(t) for t in ("The three primary colours are", "Hi")]
    counting = Counting(model.stack)
    with stack_replaced(smollm, counting):
        fused = generate(smollm, prompts)
    with stack_replaced(smollm, None):
        plain = generate(smollm, prompts)
    assert counting.rows

    def tokens(results: dict[str, Any]) -> dict[str, list[int]]:
        return {k: v.outputs[0].token_ids for k, v in results.items()}

    assert tokens(fused) == tokens(plain)


class Recording:
    """Wraps a stack and keeps each step's output."""

    def __init__(self, stack: LlamaStack) -> None:
        self.stack, self.outputs = stack, list[torch.Tensor]()

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        out = self.stack(x, *args)
        self.outputs.append(out.clone())
        return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_a_lone_decode_gets_the_bits_it_gets_among_many(
    kv_cache_dtype: str, tmp_path: Path, smollm_folder: Path
) -> None:
    """A step of fewer rows than twice the threads shares each decode's attention
    among the threads, a kv head (and its query heads) each; a bigger step attends a
    row at a time. Each head's arithmetic is the same: a prompt decoded alone leaves
    the stack with the bits it leaves it with beside seven others (int8 dot products,
    which round each row on its own, so the linear layers add no difference)."""
    lm = tiny_with_blocks("llama", tmp_path / "llama", smollm_folder, BlockType.Q8_0, int8=True)
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    assert model.config.num_heads > model.config.num_kv_heads > 1
    others = [[9 + i + j for j in range(5 + 3 * i)] for i in range(7)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the crowd's 8 rows are then past the split, the lone 1 not
    try:
        with stack_replaced(lm, Recording(model.stack)) as alone:
            generate(lm, [PROMPTS[2]], kv_cache_dtype=kv_cache_dtype)
        with stack_replaced(lm, Recording(model.stack)) as crowd:
            generate(lm, [PROMPTS[2], *others], kv_cache_dtype=kv_cache_dtype)
    finally:
        torch.set_num_threads(threads)
    decodes = zip(alone.outputs[1:], crowd.outputs[1:], strict=True)
    for step, (lone, among) in enumerate(decodes, start=1):
        assert lone.shape[0] == 1 and among.shape[0] == 8
        # the lone row is one of the eight (the others' prompts differ from it)
        assert any(torch.equal(lone[0], row) for row in among), f"step {step}"


def test_torch_attention_turns_the_stack_off(smollm: LoadedLM, smollm_folder: Path) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    counting = Counting(model.stack)
    with stack_replaced(smollm, counting):
        generate(smollm, PROMPTS[:2], attention_kernel="torch")
    assert counting.rows == []
    plain = load_causal_lm(smollm_folder, progress=False, weight_kernel="torch").model
    assert isinstance(plain, LlamaForCausalLM) and plain.stack is None


def meta(rows: int, prefill: bool = False, native: bool = True) -> AttentionMetadata:
    seqs = rows + 1 if prefill else rows
    tables = torch.zeros(seqs, 1, dtype=torch.long)
    row_seqs = torch.tensor(list(range(rows)) + [rows] * 4 * prefill)
    lens = torch.tensor([1] * rows + [1, 2, 3, 4] * prefill)
    kernel = compile_decode_kernel()
    decode = NativeDecode(rows, tables, row_seqs, lens, kernel) if native else None
    segments = (PrefillSegment(rows, 4, 0, torch.zeros(1, dtype=torch.long), None),)
    return AttentionMetadata(
        torch.zeros(len(lens), dtype=torch.long), (), segments if prefill else (), decode
    )


def test_the_stack_applies_where_attention_is_native_and_rows_are_float32() -> None:
    assert LlamaStack.applies(torch.zeros(300, 8), meta(300))
    assert LlamaStack.applies(torch.zeros(6, 8), meta(2, prefill=True))
    assert not LlamaStack.applies(torch.zeros(6, 8), meta(2, prefill=True, native=False))
    assert not LlamaStack.applies(torch.zeros(6, 8).double(), meta(2, prefill=True))


@pytest.mark.parametrize("bad_block", [10**6, -1])
def test_a_corrupted_block_table_fails_its_request_not_the_process(
    tmp_path: Path, smollm_folder: Path, bad_block: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The C side would follow the entry wherever it points; the wrapper refuses it,
    so the step raises, the engine retries its sequences one by one, and only the
    request whose table is corrupted fails."""
    lm = tiny_with_blocks("llama", tmp_path / "llama", smollm_folder, BlockType.Q4_1)
    bad, good = PROMPTS[2], PROMPTS[3]
    solo = generate(lm, [good])["0"].outputs[0].token_ids
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    real = model.stack

    def corrupting(x: torch.Tensor, positions: Any, caches: Any, meta: Any) -> torch.Tensor:
        if x.shape[0] in (len(bad) + len(good), len(bad)):  # a step holding the bad prompt
            meta.native.block_tables[0, 0] = bad_block
        return real(x, positions, caches, meta)

    with stack_replaced(lm, corrupting), caplog.at_level("ERROR"):
        results = generate(lm, [bad, good])
    assert results["0"].error is not None
    assert results["1"].error is None and results["1"].outputs[0].token_ids == solo
    assert "block_tables holds" in caplog.text


def test_the_stack_refuses_metadata_that_does_not_fit(smollm: LoadedLM) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    stack = model.stack
    caches = [torch.zeros(2, 4, 16, smollm.config.num_kv_heads, smollm.config.head_dim)] * len(
        model.layers
    )
    x = torch.zeros(2, smollm.config.hidden_size)
    positions = torch.tensor([0, 1])
    good = meta(2)
    stack(x.clone(), positions, caches, good)  # fits: runs
    native = good.native
    assert native is not None
    cases = {
        "context_lens": NativeDecode(
            2, native.block_tables, native.row_seqs, torch.tensor([1, 65]), native.kernel
        ),
        "row_seqs": NativeDecode(
            2, native.block_tables, torch.tensor([0, 2]), native.context_lens, native.kernel
        ),
    }
    for name, decode in cases.items():
        with pytest.raises(ValueError, match=name):
            stack(
                x.clone(), positions, caches, AttentionMetadata(good.slot_mapping, (), (), decode)
            )
    with pytest.raises(ValueError, match="slots"):
        stack(
            x.clone(), positions, caches, AttentionMetadata(torch.tensor([0, 64]), (), (), native)
        )
    with pytest.raises(ValueError, match="x has shape"):
        stack(torch.zeros(2, 7), positions, caches, good)
    rope_rows = model.stack_shape().rope.cos_table.shape[0]
    for outside in (rope_rows, -1):  # past the rotary tables
        with pytest.raises(ValueError, match="positions holds"):
            stack(x.clone(), torch.tensor([0, outside]), caches, good)


def test_the_stack_refuses_a_layer_whose_norms_the_kernel_cannot_read(
    smollm: LoadedLM,
) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.stack is not None
    weights, shape = model.stack_weights(), model.stack_shape()
    first = weights[0]
    cases = {
        "input_norm": dataclasses.replace(first, input_norm=None),  # type: ignore[arg-type]
        "post_norm": dataclasses.replace(first, post_norm=first.post_norm[:-1]),
        "q_norm": dataclasses.replace(
            first, q_norm=torch.ones(shape.head_dim - 1), k_norm=torch.ones(shape.head_dim)
        ),
        "k_norm": dataclasses.replace(
            first, q_norm=torch.ones(shape.head_dim), k_norm=torch.ones(shape.head_dim + 1)
        ),
        "mlp_out_norm": dataclasses.replace(
            first, mlp_out_norm=torch.ones(shape.hidden_size, dtype=torch.float64)
        ),
    }
    for name, layer in cases.items():
        with pytest.raises(ValueError, match=name):
            LlamaStack([layer, *weights[1:]], shape)
