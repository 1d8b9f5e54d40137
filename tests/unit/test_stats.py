"""A statistics snapshot is a copy: what the engine records after it taken does not
change it (an engine process sends one whenever a request finishes)."""

from __future__ import annotations

import dataclasses

from carpool.stats import EngineStats, Histogram


def test_an_engine_snapshot_shares_nothing_mutable_with_the_live_statistics() -> None:
    stats = EngineStats()
    with stats.update() as s:
        s.steps = 2
        s.finished["stop"] = 1
        s.time_to_first_token.observe(0.02)
    before = stats.snapshot()
    with stats.update() as s:
        s.steps = 3
        s.finished["stop"] += 1
        s.finished["length"] = 1
        for field in dataclasses.fields(s):
            value = getattr(s, field.name)
            if isinstance(value, Histogram):
                value.observe(0.5)
    assert before.steps == 2
    assert before.finished == {"stop": 1}
    assert before.time_to_first_token.count == 1
    assert before.time_to_first_token.total == 0.02
    assert before.tokens_per_step.count == 0
    assert stats.snapshot().time_to_first_token.count == 2
