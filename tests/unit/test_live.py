"""The dashboard's live statistics: percentiles read from histogram buckets as
Prometheus reads them, rates and means between samples, the last minute's window,
and sampling only when asked."""

from __future__ import annotations

import pytest

from carpool.server.observability.live import KEEP_S, LiveStats, Reading, Sample, quantile, view
from carpool.stats import (
    BatcherStatsData,
    EngineStatsData,
    Histogram,
    Outcome,
    RuntimeStats,
    RuntimeStatsData,
)


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile() -> None:
    bounds = (0.01, 0.02, 0.05)
    # 10 observations <= 0.01, 30 in (0.01, 0.02], 10 in (0.02, 0.05], none above.
    counts = [10, 30, 10, 0]
    assert quantile(bounds, counts, 0.5) == pytest.approx(0.01 + 0.01 * (25 - 10) / 30)
    assert quantile(bounds, counts, 0.1) == pytest.approx(0.005)  # the first bucket starts at 0
    assert quantile(bounds, counts, 0.99) == pytest.approx(0.02 + 0.03 * (49.5 - 40) / 10)
    assert quantile(bounds, [0, 0, 0, 4], 0.5) == 0.05  # above every bound: the last one
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None


def engine(tokens: int, steps: int, step_tokens: int, *, running: int = 0) -> EngineStatsData:
    s = EngineStatsData(generation_tokens=tokens, prompt_tokens=2 * tokens, steps=steps)
    s.running = running
    s.tokens_per_step = Histogram((1, 8, 64), [0, steps, 0, 0], float(step_tokens))
    return s


def batcher(inferences: int, batches: int) -> BatcherStatsData:
    s = BatcherStatsData(inference_count=inferences, execution_count=batches)
    s.outcomes[Outcome.SUCCESS] = inferences
    return s


def sample(t: float, e: EngineStatsData, b: BatcherStatsData, busy: dict[str, float]) -> Sample:
    runtime = RuntimeStatsData(units={k: 1 for k in busy}, busy_s=busy)
    return Sample(t, {"chat": e}, {"chat": 16}, {"embed": b}, runtime)


def test_view_derives_rates_means_and_totals_between_samples() -> None:
    samples = [
        sample(100.0, engine(0, 0, 0), batcher(0, 0), {"chat": 0.0}),
        sample(102.0, engine(40, 10, 40, running=4), batcher(8, 2), {"chat": 1.5, "embed": 0.2}),
        sample(103.0, engine(40, 10, 40), batcher(20, 3), {"chat": 1.5, "embed": 0.6}),
    ]
    v = view(samples)
    chat = v["models"]["chat"]
    assert chat["series"]["t"] == [102.0, 103.0]
    assert chat["series"]["generation_tokens_per_s"] == [20.0, 0.0]
    assert chat["series"]["prompt_tokens_per_s"] == [40.0, 0.0]
    assert chat["series"]["tokens_per_step"] == [4.0, None]  # no step in the second second
    assert chat["series"]["running"] == [4, 0]
    assert chat["totals"]["generation_tokens"] == 40
    embed = v["models"]["embed"]
    assert embed["series"]["requests_per_s"] == [4.0, 12.0]
    assert embed["series"]["batch_size"] == [4.0, 12.0]
    assert embed["totals"] == {
        "requests": {o.value: (20 if o is Outcome.SUCCESS else 0) for o in Outcome},
        "batches": 3,
        "inferences": 20,
    }
    assert v["runtime"]["series"] == {
        "t": [102.0, 103.0],
        "chat": [0.75, 0.0],
        "embed": [0.1, pytest.approx(0.4)],
    }


def test_the_window_covers_the_last_minute_only() -> None:
    old, recent, now = EngineStatsData(), EngineStatsData(), EngineStatsData()
    old.prefix_queries, old.prefix_hits = 100, 100  # all hits, 70 s ago
    recent.prefix_queries, recent.prefix_hits = 100, 100
    now.prefix_queries, now.prefix_hits = 110, 102  # 2 hits of 10 since 50 s ago
    now.spec_draft_tokens, now.spec_accepted_tokens = 8, 6
    now.finished = {"stop": 3, "timeout": 1}
    for latency in (0.1, 0.1, 0.1):
        now.time_to_first_token.observe(latency)
    samples = [
        Sample(t, {"chat": s}, {"chat": 16}, {}, RuntimeStatsData())
        for t, s in ((30.0, old), (50.0, recent), (100.0, now))
    ]
    v = view(samples)
    window = v["models"]["chat"]["window"]
    assert v["window_s"] == 50.0
    assert window["prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert window["spec_acceptance"] == pytest.approx(0.75)
    assert window["errors"] == {"abort": 0, "timeout": 1, "error": 0, "rejected": 0}
    assert window["ttft_s"]["p50"] == pytest.approx(0.075)  # halfway into (0.05, 0.1]
    # The totals are /metrics' counters: prefix-cache counts in tokens (blocks x 16).
    assert v["models"]["chat"]["totals"]["prefix_cache_hits"] == 102 * 16


def test_one_sample_gives_totals_and_since_start_percentiles() -> None:
    e = EngineStatsData()
    e.inter_token_latency.observe(0.012)
    v = view([Sample(5.0, {"chat": e}, {"chat": 16}, {}, RuntimeStatsData())])
    assert v["window_s"] is None
    assert v["models"]["chat"]["series"]["t"] == v["models"]["chat"]["series"]["running"] == []
    assert v["models"]["chat"]["window"]["itl_s"]["p50"] == pytest.approx(0.01125)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_samples_are_taken_only_when_asked_and_shared_by_close_viewers() -> None:
    reads: list[float] = []
    clock = Clock()

    def read() -> Reading:
        reads.append(clock.t)
        return Reading({}, {}, {"embed": batcher(len(reads), len(reads))})

    live = LiveStats(read, RuntimeStats(), clock)
    assert reads == []  # nothing happens until somebody looks
    live.view()
    clock.t += 0.2
    live.view()  # a second viewer 0.2 s later shares the sample
    assert reads == [1000.0]
    clock.t += 1.0
    assert live.view()["models"]["embed"]["series"]["t"] == [1001.2]
    clock.t += KEEP_S + 1
    v = live.view()  # older samples dropped: this one stands alone
    assert v["window_s"] is None and v["models"]["embed"]["series"]["t"] == []


def test_a_model_loaded_meanwhile_has_points_from_when_it_came() -> None:
    empty = RuntimeStatsData()
    samples = [
        Sample(100.0, {}, {}, {}, empty),
        Sample(101.0, {}, {}, {"user": batcher(0, 0)}, empty),
        Sample(102.0, {}, {}, {"user": batcher(6, 2)}, empty),
        Sample(103.0, {}, {}, {"user": batcher(8, 3), "later": batcher(0, 0)}, empty),
    ]
    v = view(samples)
    assert v["models"]["user"]["series"]["t"] == [102.0, 103.0]
    assert v["models"]["user"]["series"]["requests_per_s"] == [6.0, 2.0]
    assert v["models"]["later"]["series"]["t"] == []


def test_a_model_unloaded_and_loaded_again_counts_afresh() -> None:
    empty = RuntimeStatsData()
    samples = [
        Sample(100.0, {}, {}, {"user": batcher(0, 0)}, empty, {"user": 1}),
        Sample(101.0, {}, {}, {"user": batcher(9, 3)}, empty, {"user": 1}),
        Sample(102.0, {}, {}, {}, empty),  # unloaded
        Sample(103.0, {}, {}, {"user": batcher(0, 0)}, empty, {"user": 2}),
        Sample(104.0, {}, {}, {"user": batcher(4, 2)}, empty, {"user": 2}),
    ]
    v = view(samples)["models"]["user"]
    assert v["series"]["t"] == [104.0]  # only the pair within the second load
    assert v["series"]["requests_per_s"] == [4.0]
    assert v["totals"]["requests"]["success"] == 4
    back_to_back = [samples[1], Sample(101.5, {}, {}, {"user": batcher(1, 1)}, empty, {"user": 2})]
    assert view(back_to_back)["models"]["user"]["series"]["t"] == []  # no negative rate
