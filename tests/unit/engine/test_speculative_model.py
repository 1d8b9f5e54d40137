"""Speculative decoding on the built-in model: greedy output is token for token
what decoding without it gives, alone and batched, on both attention paths, while
drafts are in fact accepted; sampled output ends whole. (The sampled path's
distribution is tested exactly, on known logits, in test_sampler.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.config import EngineConfig
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.models.packed_linear import quantized_linear_kernel
from carpool.workers.factory import engine_for

SPECULATE = '{"num_speculative_tokens": 5, "disable_by_batch_size": 4}'
TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump!"
)
PROMPTS = [
    f"Copy this text exactly.\nText: {TEXT}\nCopy: {TEXT}\nCopy:",
    'Fill the record.\n{"name": "Ada", "city": "London", "year": 1843}\n{"name": "Ada",',
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
]


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals = {}
    every = [s for r in engine.outputs.requests.values() for s in r.seqs]
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check(every)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return [finals[str(i)] for i in range(len(prompts))]


def test_greedy_speculation_gives_the_tokens_of_plain_decoding(smollm: LoadedLM) -> None:
    check_greedy_identity(smollm, "auto", alone=True)


def test_greedy_speculation_on_torch_attention_gives_the_batched_tokens(smollm: LoadedLM) -> None:
    """The other attention path, batched only (its steps run ~3x slower here: the
    suite's time bounds it)."""
    check_greedy_identity(smollm, "torch", alone=False)


def test_greedy_speculation_keeps_the_tokens_with_int8_dot_products(
    smollm_folder: Path,
) -> None:
    """Not exact arithmetic, but the same for a row whatever its step: a verified
    row gets the bits its decode would (last bits there can move an int8 rounding)."""
    if not quantized_linear_kernel(int8_dots=True).interleaved_vectorized:
        pytest.skip("no AVX2: int8 runs the few-rows kernels, not batch invariant")
    int8 = load_causal_lm(smollm_folder, progress=False, weight_kernel="native-int8")
    check_greedy_identity(int8, "auto", alone=False)


def check_greedy_identity(lm: LoadedLM, attention: str, alone: bool) -> None:
    """Speculation's greedy tokens, batched (and with ``alone`` each prompt by
    itself), against plain decoding's: each prompt alone, or batched where ``alone``
    is false (plain decoding's batch invariance is tested on its own)."""
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = engine_for(lm, EngineConfig(attention_kernel=attention))
    if alone:
        expected = [generate(plain, [p], greedy)[0] for p in prompts]
    else:
        expected = generate(plain, prompts, greedy)
    config = EngineConfig(attention_kernel=attention, speculative_config=SPECULATE)
    if alone:
        assert [generate(engine_for(lm, config), [p], greedy)[0] for p in prompts] == expected
    engine = engine_for(lm, config)
    batched = generate(engine, prompts, greedy)
    assert batched == expected
    stats = engine.stats.snapshot()
    assert stats.spec_accepted_tokens > 20  # the copies were drafted and accepted
    assert stats.steps < 40  # fewer steps than each request has tokens


def test_sampled_speculation_accepts_rejects_and_leaks_nothing(smollm: LoadedLM) -> None:
    """Sampling at temperature 1 over the copy tasks: drafts are accepted and
    rejected (the residual draws run), every request ends with all its tokens, and
    the sequences' invariants hold after every step."""
    engine = engine_for(smollm, EngineConfig(speculative_config=SPECULATE))
    prompts = [smollm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    outputs = generate(engine, prompts, params)
    assert [len(o) for o in outputs] == [32, 32, 32]
    stats = engine.stats.snapshot()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
