"""Speculation with a draft model (``{"method": "draft_model", "model": ...}``) on tiny
random models: greedy output is token for token what decoding without it gives,
alone and batched, with good drafts (the target itself) and poor ones (another
random model); sampled output ends whole with drafts both accepted and rejected; the
draft engine leaks no block; a draft model of another vocabulary is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from carpool.config import EngineConfig
from carpool.engine.draft_model import DraftModelProposer
from carpool.engine.drafting import Speculation
from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.models.causal_lm import LoadedLM, load_causal_lm
from carpool.workers.factory import engine_for
from tests import tiny_models
from tests.unit.engine.test_speculative_model import generate

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [100, 101, 102, 103, 100, 101],
    [40, 41, 42, 43, 44, 45, 46, 47, 48],
]
TOKENS = 24


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, smollm_folder: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft")
    built = {"target": (0, tiny_models.VOCAB), "other": (1, tiny_models.VOCAB), "small": (2, 256)}
    for name, (seed, vocab) in built.items():
        tiny_models.build("llama", root / name, smollm_folder, seed=seed, vocab=vocab)
    return {name: root / name for name in built}


@pytest.fixture(scope="module")
def target(folders: dict[str, Path]) -> LoadedLM:
    return load_causal_lm(folders["target"], progress=False)


def with_draft(lm: LoadedLM, draft: Path, k: int = 4) -> Engine:
    config = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": k,
        "draft_kv_cache_memory": "4MiB",
    }
    engine = EngineConfig(kv_cache_memory="8MiB", speculative_config=json.dumps(config))
    return engine_for(lm, engine)


def draft_engine(engine: Engine) -> Engine:
    assert isinstance(engine.drafter, Speculation)
    proposer = engine.drafter.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer.engine


@pytest.mark.parametrize("draft", ["target", "other"])
def test_greedy_with_a_draft_model_gives_the_tokens_of_plain_decoding(
    target: LoadedLM, folders: dict[str, Path], draft: str
) -> None:
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    plain = engine_for(target, EngineConfig(kv_cache_memory="8MiB"))
    expected = [generate(plain, [p], greedy)[0] for p in PROMPTS]
    alone = [generate(with_draft(target, folders[draft]), [p], greedy)[0] for p in PROMPTS]
    engine = with_draft(target, folders[draft])
    batched = generate(engine, PROMPTS, greedy)
    assert alone == expected
    assert batched == expected
    stats = engine.stats.snapshot()
    assert stats.spec_draft_tokens > 0
    if draft == "target":  # the model drafting for itself: nearly every draft holds
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens
        assert stats.steps < TOKENS
    drafts = draft_engine(engine)
    assert not drafts.has_work
    assert drafts.blocks.num_free == drafts.blocks.num_blocks


def test_sampled_speculation_with_a_draft_model_ends_whole(
    target: LoadedLM, folders: dict[str, Path]
) -> None:
    engine = with_draft(target, folders["target"])
    params = SamplingParams(max_tokens=TOKENS, temperature=0.3, seed=3, ignore_eos=True)
    outputs = generate(engine, PROMPTS, params)
    assert [len(o) for o in outputs] == [TOKENS] * len(PROMPTS)
    stats = engine.stats.snapshot()
    # Drafts are greedy and the target samples (a tiny random model is nearly
    # uniform at temperature 1): some are taken, some are not.
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused(
    target: LoadedLM, folders: dict[str, Path]
) -> None:
    with pytest.raises(ValueError, match="256 tokens in its vocabulary and the target 512"):
        with_draft(target, folders["small"])


def test_the_built_in_model_takes_a_draft_without_blocks_under_native_kernels(
    smollm: LoadedLM, smollm_folder: Path, tmp_path: Path
) -> None:
    """A draft only proposes: under ``weight_kernel native`` (which the target's GGUF
    blocks satisfy) a draft model without blocks still loads, and the built-in
    model's greedy tokens do not change."""
    draft = tmp_path / "draft"
    tiny_models.build("llama", draft, smollm_folder, vocab=smollm.config.vocab_size)
    config = json.dumps(
        {"method": "draft_model", "model": str(draft), "draft_kv_cache_memory": "8MiB"}
    )
    prompt = smollm.tokenizer.encode("Count: one, two, three, four, five, six,")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = generate(engine_for(smollm, EngineConfig(weight_kernel="native")), [prompt], greedy)
    engine = engine_for(smollm, EngineConfig(weight_kernel="native", speculative_config=config))
    assert generate(engine, [prompt], greedy) == expected
    assert engine.stats.snapshot().spec_draft_tokens > 0
