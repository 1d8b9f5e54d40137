"""The fused decode stack: a step of few single-token rows runs every decoder layer
in one native call and gives what the layer-by-layer path gives; it runs exactly
where it applies, and the kernel settings turn it off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from carpool.config import EngineConfig
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.attention import AttentionMetadata, NativeDecode, PrefillSegment
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.models.decode_kernel import compile_decode_kernel
from carpool.models.llama import LlamaForCausalLM
from carpool.models.llama_decode import LlamaDecodeStack
from carpool.models.packed_linear import (
    MAX_KERNEL_ROWS,
    BlockType,
    PackedWeight,
    quantized_linear_kernel,
)
from tests import tiny_models

KINDS = {BlockType.Q4_1: GGMLQuantizationType.Q4_1, BlockType.Q8_0: GGMLQuantizationType.Q8_0}
PROMPTS = [[5 + i for i in range(n)] for n in (3, 17, 40, 9, 64)]


def tiny_with_blocks(arch: str, folder: Path, smollm_folder: Path, kind: BlockType) -> LoadedLM:
    """A tiny random ``arch`` model whose decoder linear weights are ``kind`` blocks
    (the float32 weights are what the blocks hold), with the blocks attached."""
    tiny_models.build(arch, folder, smollm_folder)
    tensors = load_file(str(folder / "model.safetensors"))
    packed = {}
    for name, weight in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            raw = quantize(weight.numpy(), KINDS[kind])
            values = np.array(dequantize(raw, KINDS[kind]), dtype=np.float32)
            tensors[name] = torch.from_numpy(values).reshape(weight.shape)
            packed[name] = PackedWeight.from_gguf_blocks(kind, raw)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    lm = load_causal_lm(folder, progress=False, weight_kernel="torch")
    model = lm.model
    assert isinstance(model, LlamaForCausalLM)
    assert model.attach_packed(packed, quantized_linear_kernel()) == 4 * lm.config.num_layers
    return lm


class Counting:
    """Wraps a stack and counts the rows of each step it runs."""

    def __init__(self, stack: LlamaDecodeStack) -> None:
        self.stack, self.rows = stack, list[int]()

    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.stack(x, *args)


@contextmanager
def stack_replaced(lm: LoadedLM, replacement: Any) -> Iterator[None]:
    model = lm.model
    assert isinstance(model, LlamaForCausalLM)
    kept = model.decode_stack
    model.decode_stack = replacement
    try:
        yield
    finally:
        model.decode_stack = kept


def generate(lm: LoadedLM, prompts: list[list[int]], **engine: Any) -> dict[str, Any]:
    """Greedy tokens and top-3 logprobs per prompt, all prompts running together."""
    eng = Engine(lm, EngineConfig(kv_cache_memory="16MiB", block_size=16, **engine))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    results: dict[str, Any] = {}
    while eng.has_work:
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    return results


@pytest.mark.parametrize(
    ("arch", "kind"),
    [
        ("llama", BlockType.Q4_1),
        ("mistral", BlockType.Q8_0),
        ("qwen2", BlockType.Q4_1),  # QKV bias
    ],
)
def test_the_stack_gives_the_layer_by_layer_results(
    arch: str, kind: BlockType, tmp_path: Path, smollm_folder: Path
) -> None:
    lm = tiny_with_blocks(arch, tmp_path / arch, smollm_folder, kind)
    model = lm.model
    assert isinstance(model, LlamaForCausalLM) and model.decode_stack is not None
    counting = Counting(model.decode_stack)
    with stack_replaced(lm, counting):
        fused = generate(lm, PROMPTS)
    with stack_replaced(lm, None):
        plain = generate(lm, PROMPTS)
    assert counting.rows and max(counting.rows) == len(PROMPTS)
    for key, expected in plain.items():
        assert fused[key].token_ids == expected.token_ids
        for ours, theirs in zip(fused[key].logprobs, expected.logprobs, strict=True):
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
            np.testing.assert_allclose(
                [p for _, p in ours.top], [p for _, p in theirs.top], rtol=1e-4, atol=1e-5
            )


def test_the_builtin_model_decodes_on_the_stack(smollm: LoadedLM) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.decode_stack is not None
    prompts = [smollm.tokenizer.encode(t) for t in ("The three primary colours are", "Hi")]
    counting = Counting(model.decode_stack)
    with stack_replaced(smollm, counting):
        fused = generate(smollm, prompts)
    with stack_replaced(smollm, None):
        plain = generate(smollm, prompts)
    assert counting.rows
    assert {k: v.token_ids for k, v in fused.items()} == {k: v.token_ids for k, v in plain.items()}


def test_torch_attention_turns_the_stack_off(smollm: LoadedLM, smollm_folder: Path) -> None:
    model = smollm.model
    assert isinstance(model, LlamaForCausalLM) and model.decode_stack is not None
    counting = Counting(model.decode_stack)
    with stack_replaced(smollm, counting):
        generate(smollm, PROMPTS[:2], attention_kernel="torch")
    assert counting.rows == []
    plain = load_causal_lm(smollm_folder, progress=False, weight_kernel="torch").model
    assert isinstance(plain, LlamaForCausalLM) and plain.decode_stack is None


def meta(rows: int, prefill: bool = False, native: bool = True) -> AttentionMetadata:
    tables = torch.zeros(rows, 1, dtype=torch.long)
    lens = torch.ones(rows, dtype=torch.long)
    decode = NativeDecode(rows, tables, lens, compile_decode_kernel()) if native else None
    segments = (PrefillSegment(rows, 4, 0, torch.zeros(1, dtype=torch.long), None),)
    return AttentionMetadata(
        torch.zeros(rows, dtype=torch.long), (), segments if prefill else (), decode
    )


def test_the_stack_applies_to_few_single_token_rows_only() -> None:
    x = torch.zeros(MAX_KERNEL_ROWS, 8)
    assert LlamaDecodeStack.applies(x, meta(MAX_KERNEL_ROWS))
    assert not LlamaDecodeStack.applies(
        torch.zeros(MAX_KERNEL_ROWS + 1, 8), meta(MAX_KERNEL_ROWS + 1)
    )
    assert not LlamaDecodeStack.applies(torch.zeros(6, 8), meta(2, prefill=True))
    assert not LlamaDecodeStack.applies(x, meta(MAX_KERNEL_ROWS, native=False))
    assert not LlamaDecodeStack.applies(x.double(), meta(MAX_KERNEL_ROWS))
