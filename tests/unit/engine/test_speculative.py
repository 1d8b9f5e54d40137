"""Prompt-lookup drafting: which tokens it proposes, when it stays quiet, and its
adaptive pause. Torch-free (``scripts/check_core.sh`` runs it without torch)."""

from __future__ import annotations

import pytest

from carpool.config import ConfigError, SpeculativeConfig
from carpool.engine.speculative import NgramIndex, Speculator


def test_the_longest_recurring_tail_proposes_what_followed_its_latest_occurrence() -> None:
    index = NgramIndex(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # Tail (5, 6, 7) occurred at 0-2, followed by 8 1 6; (6, 7) more recently at 5-6,
    # but the longer match wins.
    assert index.propose(tokens, 3) == [8, 1, 6]
    tokens += [2]  # tail (7, 2) and (2,) never occurred: nothing
    assert index.propose(tokens, 3) == []
    tokens += [6, 7]  # (2, 6, 7) no; (6, 7) latest at 9-10, followed by 2 6 7
    assert index.propose(tokens, 4) == [2, 6, 7]
    assert index.propose(tokens, 1) == [2]


def step(
    spec: Speculator, decoding: list[tuple[str, list[int], int]], running: int = 1
) -> dict[str, list[int]]:
    """One engine step's drafts, as the engine asks for them."""
    return spec.drafts(decoding) if spec.drafting(running) else {}


def test_drafts_respect_the_room_the_batch_size_and_each_sequences_acceptance() -> None:
    config = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=2)
    spec = Speculator(config)
    loop = [1, 2, 3, 4] * 3
    assert step(spec, [("a", loop, 5)], 1) == {"a": [1, 2, 3]}
    assert step(spec, [("a", loop, 2)], 1) == {"a": [1, 2]}  # room for two
    assert step(spec, [("a", loop, 0)], 1) == {}
    assert step(spec, [("a", loop, 5), ("b", loop, 5)], 3) == {}  # batch too big
    # Rejected drafts lower a sequence's acceptance until it pauses; it tries again
    # after the pause, and the next pause is longer.
    for _ in range(4):
        spec.accepted("a", 3, 0)
    paused = 0
    while not step(spec, [("a", loop, 5)], 1):
        paused += 1
    assert paused >= 7
    spec.accepted("a", 3, 0)
    spec.accepted("a", 3, 0)
    longer = 0
    while not step(spec, [("a", loop, 5)], 1):
        longer += 1
    assert longer > paused
    spec.forget("a")
    assert step(spec, [("a", loop, 5)], 1) == {"a": [1, 2, 3]}  # a fresh start


def test_a_sequence_drafts_about_one_token_more_than_it_gets_accepted() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=5, min_acceptance=0.1))
    loop = [1, 2, 3, 4, 5, 6, 7] * 3
    assert len(step(spec, [("a", loop, 9)], 1)["a"]) == 5
    for _ in range(10):  # one token of each draft accepted
        spec.accepted("a", 5, 1)
    assert len(step(spec, [("a", loop, 9)], 1)["a"]) == 3  # ceil(run) + 1
    for _ in range(10):
        spec.accepted("a", 5, 5)
    assert len(step(spec, [("a", loop, 9)], 1)["a"]) == 5  # back to the cap


def test_the_config_is_json_with_known_keys_and_ranges() -> None:
    parsed = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 6}')
    assert parsed.num_speculative_tokens == 6 and parsed.prompt_lookup_max == 4
    for bad in (
        "{",
        '{"method": "eagle"}',
        '{"num_speculative_tokens": 0}',
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 4}',
        '{"draft_model": "x"}',
        '{"method": "draft_model"}',  # which model?
        '{"method": "ngram", "model": "x"}',
        '{"method": "draft_model", "model": "x", "draft_kv_cache_memory": "lots"}',
        "[1]",
    ):
        with pytest.raises(ConfigError):
            SpeculativeConfig.parse(bad)
    draft = SpeculativeConfig.parse('{"method": "draft_model", "model": "tiny"}')
    assert draft.model == "tiny" and draft.draft_kv_cache_memory == "64MiB"
    with pytest.raises(ValueError, match="needs its proposer"):
        Speculator(draft)
