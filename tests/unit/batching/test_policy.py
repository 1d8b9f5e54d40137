"""The batching policy decides when a batch goes and what is in it (pure, fake times)."""

from __future__ import annotations

from carpool.batching.policy import SendBatch, WaitUntil, decide, select
from carpool.batching.request import BatchRequest
from carpool.config import BatchingConfig


def req(cost: int, arrival: float, level: int = 1) -> BatchRequest:
    return BatchRequest(
        payload=None, cost=cost, level=level, arrival=arrival, deadline=arrival + 100
    )


def ordered(requests: list[BatchRequest]) -> list[BatchRequest]:
    return sorted(requests, key=lambda r: (r.level, r.arrival))


def test_nothing_waiting_means_no_decision() -> None:
    assert decide([], 0.0, BatchingConfig(), ragged=True) is None


def test_without_delay_everything_waiting_goes_at_once() -> None:
    waiting = [req(5, t) for t in range(5)]
    decision = decide(waiting, 10.0, BatchingConfig(max_queue_delay_ms=0), ragged=True)
    assert isinstance(decision, SendBatch)
    assert set(map(id, decision.requests)) == set(map(id, waiting))


def test_delay_holds_the_batch_until_the_oldest_has_waited_it_out() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=100, max_batch_size=8)
    waiting = [req(5, 1.0), req(5, 1.05)]
    assert decide(waiting, 1.05, cfg, ragged=True) == WaitUntil(1.1)
    decision = decide(waiting, 1.1, cfg, ragged=True)
    assert isinstance(decision, SendBatch) and len(decision.requests) == 2


def test_a_full_batch_goes_before_the_delay() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=1000, max_batch_size=3)
    waiting = [req(5, 1.0 + i / 100) for i in range(4)]
    decision = decide(waiting, 1.1, cfg, ragged=True)
    assert isinstance(decision, SendBatch) and len(decision.requests) == 3
    assert waiting[0] in decision.requests


def test_preferred_size_goes_before_the_delay_trimmed_to_the_largest_preferred() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=1000, max_batch_size=16, preferred_batch_sizes=(2, 4))
    assert isinstance(decide([req(5, 1.0)], 1.0, cfg, ragged=True), WaitUntil)
    waiting = [req(5, 1.0 + i / 100) for i in range(5)]
    decision = decide(waiting, 1.1, cfg, ragged=True)
    assert isinstance(decision, SendBatch) and len(decision.requests) == 4
    assert decision.requests[0] is waiting[0]


def test_token_budget_counts_padding_for_padded_models_and_sums_for_ragged() -> None:
    cfg = BatchingConfig(max_batch_tokens=100, max_batch_size=64)
    waiting = [req(40, 1.0), req(10, 2.0), req(10, 3.0), req(10, 4.0)]
    ragged, _ = select(waiting, cfg, ragged=True)
    padded, _ = select(waiting, cfg, ragged=False)
    assert sum(r.cost for r in ragged) <= 100 and len(ragged) == 4  # 40 + 30
    assert max(r.cost for r in padded) * len(padded) <= 100 and len(padded) == 2  # 40 * 2


def test_the_oldest_request_always_goes_even_if_over_budget() -> None:
    cfg = BatchingConfig(max_batch_tokens=10)
    chosen, full = select([req(500, 1.0), req(5, 2.0)], cfg, ragged=True)
    assert [r.cost for r in chosen] == [500] and full


def test_similar_lengths_are_grouped_around_the_oldest() -> None:
    cfg = BatchingConfig(max_batch_size=3)
    waiting = [req(50, 0.0), req(5, 1.0), req(48, 2.0), req(6, 3.0), req(52, 4.0)]
    chosen, full = select(waiting, cfg, ragged=False)
    assert sorted(r.cost for r in chosen) == [48, 50, 52] and full


def test_best_priority_first_then_lower_levels_fill() -> None:
    cfg = BatchingConfig(max_batch_size=2, priority_levels=2)
    low_old = req(5, 0.0, level=2)
    high_new = req(5, 5.0, level=1)
    low_newer = req(5, 6.0, level=2)
    chosen, _ = select(ordered([low_old, high_new, low_newer]), cfg, ragged=True)
    assert chosen == [high_new, low_old]


def sized(size: int, arrival: float, group: object = None) -> BatchRequest:
    return BatchRequest(
        payload=None, cost=1, level=1, arrival=arrival, deadline=arrival + 100, size=size,
        group=group,
    )  # fmt: skip


def test_only_the_anchors_group_joins_its_batch() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=0, max_batch_size=8)
    a1, b1, a2, b2 = sized(1, 0, "a"), sized(1, 1, "b"), sized(1, 2, "a"), sized(1, 3, "b")
    decision = decide([a1, b1, a2, b2], 5.0, cfg, ragged=False)
    assert isinstance(decision, SendBatch)
    assert decision.requests == [a1, a2]


def test_a_request_takes_as_many_slots_as_its_batch_dimension() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=0, max_batch_size=4)
    first, second, third = sized(3, 0), sized(2, 1), sized(1, 2)
    chosen, full = select([first, second, third], cfg, ragged=True)
    assert chosen == [first, third]  # 3 + 2 would be 5 slots
    assert full


def test_preferred_sizes_count_slots() -> None:
    cfg = BatchingConfig(max_queue_delay_ms=1000, max_batch_size=8, preferred_batch_sizes=(4,))
    three, one = sized(3, 0.0), sized(1, 0.1)
    assert isinstance(decide([three], 0.2, cfg, ragged=True), WaitUntil)
    decision = decide([three, one], 0.2, cfg, ragged=True)
    assert isinstance(decision, SendBatch) and decision.requests == [three, one]
