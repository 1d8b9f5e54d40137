"""The CPU runner computes a step's logits a part of its sampling rows at a time
(``HEAD_BYTES``): the parts split the chunks as ``head_parts`` says, and the tokens,
log-probabilities and prompt log-probabilities are those of computing all rows at
once (the floats but for float32's last bits), for greedy, seeded sampled and
speculated (draft-verifying) requests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from carpool.config import EngineConfig
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM
from carpool.workers import model_runner
from carpool.workers.factory import engine_for
from carpool.workers.model_runner import ModelRunner, head_parts

PROMPTS = [
    "Copy this text exactly.\nText: the cat sat on the mat.\nCopy: the cat sat on the mat.\nCopy:",
    "Count: one, two, three, four,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "The capital of France is",
]


def test_head_parts_keep_chunks_whole_and_within_the_limit() -> None:
    assert head_parts([], 4) == []
    assert head_parts([1, 1, 1, 1, 1], 2) == [(0, 2), (2, 4), (4, 5)]
    # a chunk with more rows than the limit (a draft's) is a part of its own
    assert head_parts([1, 6, 1, 1], 2) == [(0, 1), (1, 2), (2, 4)]
    assert head_parts([3, 1], 8) == [(0, 2)]


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    finals = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.blocks.num_free == engine.blocks.num_blocks
    return [finals[str(i)] for i in range(len(prompts))]


def outcome(out: Any) -> tuple[list[int], list[float]]:
    """The tokens (with each log-probability's alternatives) and every log-probability."""
    completion = out.outputs[0]
    entries = [e for e in [*completion.logprobs, *(out.prompt_logprobs or [])] if e is not None]
    tokens = completion.token_ids + [t for e in entries for t, _ in e.top]
    return tokens, [e.logprob for e in entries] + [v for e in entries for _, v in e.top]


MODES = {  # the engine's config, and whether each request may speculate or overlap
    "logprobs": (EngineConfig(), False),
    "overlap": (EngineConfig(async_scheduling=True), True),
    "speculate": (EngineConfig(speculative_config='{"num_speculative_tokens": 4}'), True),
}


@pytest.mark.parametrize("mode", MODES)
def test_logits_in_parts_give_what_all_rows_at_once_give(
    smollm: LoadedLM, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Steps that wait (``execute``), launched steps (``launch``, where no request
    asks for log-probabilities) and steps that verify drafts."""
    config, plain = MODES[mode]
    prompts = [smollm.tokenizer.encode(p) for p in PROMPTS]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
    ]
    if plain:
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 3
        params.append(SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True))
    launched = 0
    launch = ModelRunner.launch

    def counted_launch(*args: Any) -> Any:
        nonlocal launched
        launched += 1
        return launch(*args)

    monkeypatch.setattr(ModelRunner, "launch", counted_launch)

    engine = engine_for(smollm, config)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    # 2 MiB hold 10 rows of this vocabulary: one whole tile of 8 rows
    assert runner._head_rows(64) == 8
    monkeypatch.setattr(model_runner, "HEAD_BYTES", 1 << 40)
    whole = [outcome(o) for o in run(engine, prompts, params)]

    row_bytes = 4 * smollm.config.vocab_size
    monkeypatch.setattr(model_runner, "HEAD_BYTES", 2 * row_bytes)
    monkeypatch.setattr(model_runner, "HEAD_TILE", 1)
    seen: list[int] = []
    compute = smollm.model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(len(hidden))
        return compute(hidden)

    monkeypatch.setattr(smollm.model, "compute_logits", counted)
    parts = [outcome(o) for o in run(engine_for(smollm, config), prompts, params)]
    assert [tokens for tokens, _ in parts] == [tokens for tokens, _ in whole]
    # the same numbers but for float32's last bits (a few rows and many take different
    # tiles: 2e-5 apart at most here), where wrong rows would be whole units apart
    assert [floats for _, floats in parts] == [pytest.approx(f, abs=1e-4) for _, f in whole]
    # the parts held at most 2 rows, but for a draft's chunk (1 + 4 rows) alone
    assert max(seen) == (5 if mode == "speculate" else 2)
    assert seen.count(1) + seen.count(2) > 10
    assert (launched > 0) == (mode == "overlap")
