"""On a CUDA device (skipped where there is none, as on CI): the engine gives
transformers' greedy tokens there too, for the built-in model on the 20 prompts
and for tiny models of every architecture, alone and batched. The native kernels
are CPU-only, so this is the torch path: paged attention through SDPA."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from carpool.models.causal_lm import load_causal_lm
from tests import tiny_models
from tests.unit.models.test_causal_lm import builtin_prompts, generate, load_hf_builtin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_builtin_model_matches_transformers_on_cuda(smollm_folder: Path) -> None:
    lm = load_causal_lm(smollm_folder, progress=False, device="cuda")
    assert lm.device.type == "cuda"
    reference = load_hf_builtin().to("cuda")
    prompts = builtin_prompts(lm.tokenizer)
    expected = [tiny_models.hf_greedy(reference, p, 24) for p in prompts]
    got = generate(lm, prompts, 24, max_num_batched_tokens=512)
    mismatches = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not mismatches, f"prompts {mismatches} differ from transformers on CUDA"


@pytest.mark.parametrize("arch", tiny_models.ARCHITECTURES)
def test_tiny_model_matches_transformers_on_cuda(
    arch: str, tmp_path: Path, smollm_folder: Path
) -> None:
    reference = tiny_models.build(arch, tmp_path, smollm_folder).to("cuda")
    lm = load_causal_lm(tmp_path, progress=False, device="cuda")
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, tiny_models.VOCAB) for _ in range(n)] for n in (1, 7, 40, 300)]
    expected = [tiny_models.hf_greedy(reference, p, 20) for p in prompts]
    for prompt, want in zip(prompts, expected, strict=True):
        assert generate(lm, [prompt], 20) == [want]
    assert generate(lm, prompts, 20, max_num_batched_tokens=64) == expected
