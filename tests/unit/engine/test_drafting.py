"""The drafter an engine is built with: one of none, lookahead (multi-step decoding)
and speculation, chosen from the config and the runner, each giving decoding
sequences their extra tokens before a step."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from carpool.config import EngineConfig
from carpool.engine.drafting import Lookahead, NoDrafts, Speculation, drafter_for
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import Sequence

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "min_acceptance": 0.0})


def runner(multi_step: bool) -> Any:
    return SimpleNamespace(multi_step=multi_step)


def test_one_drafter_is_chosen_from_the_config_and_the_runner() -> None:
    assert isinstance(drafter_for(EngineConfig(), runner(True), None), NoDrafts)
    steps = EngineConfig(num_scheduler_steps=4)
    lookahead = drafter_for(steps, runner(True), None)
    assert isinstance(lookahead, Lookahead) and lookahead.passes == 3
    # A runner that cannot feed tokens back on the device runs one token a step.
    assert type(drafter_for(steps, runner(False), None)) is NoDrafts
    speculation = EngineConfig(speculative_config=NGRAM, num_scheduler_steps=4)
    assert isinstance(drafter_for(speculation, runner(True), None), Speculation)


def test_each_drafter_allows_the_requests_it_can_serve() -> None:
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert not NoDrafts().allows(greedy)
    assert Lookahead(3).allows(greedy) and not Lookahead(3).allows(sampled)
    assert not Lookahead(3).allows(penalised)
    speculation = drafter_for(EngineConfig(speculative_config=NGRAM), runner(False), None)
    assert speculation.allows(greedy) and speculation.allows(sampled)
    assert not speculation.allows(penalised)


def decoding(rid: str, prompt: list[int]) -> Sequence:
    seq = Sequence(rid, prompt, max_tokens=16, arrival=0.0)
    seq.num_computed = len(prompt) - 1
    return seq


def test_lookahead_goes_to_decoding_sequences_that_want_it_within_their_room() -> None:
    a, b, c = decoding("a", [1, 2, 3]), decoding("b", [4, 5]), decoding("c", [6, 7])
    prefilling = Sequence("d", [1, 2, 3, 4], max_tokens=16, arrival=0.0)
    rooms = {"a": 10, "b": 1, "c": 10, "d": 10}
    Lookahead(3).draft(
        [a, b, c, prefilling], lambda s: s.request_id != "c", lambda s: rooms[s.request_id]
    )
    assert [s.lookahead for s in (a, b, c, prefilling)] == [3, 1, 0, 0]
    assert all(s.draft == [] for s in (a, b, c, prefilling))  # nothing written as tokens


def test_speculation_drafts_from_the_sequences_own_text() -> None:
    drafter = drafter_for(EngineConfig(speculative_config=NGRAM), runner(False), None)
    seq = decoding("a", [5, 6, 7, 8, 5, 6])  # "5 6" was followed by "7 8 5"
    other = decoding("b", [5, 6, 7, 8, 5, 6])
    drafter.draft([seq, other], lambda s: s.request_id == "a", lambda s: 3)
    assert seq.draft == [7, 8, 5] and other.draft == [] and seq.lookahead == 0
