"""The dynamic batcher, driven by hand on a fake clock: every request ends exactly once."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from carpool.batching import DynamicBatcher
from carpool.clock import FakeClock
from carpool.config import BatchingConfig, QueuePolicy
from carpool.errors import (
    BatchFailed,
    InvalidRequest,
    ModelExecutionError,
    ModelNotFound,
    Overloaded,
    QueueTimeout,
)
from carpool.runtime import IDLE, Venue, WorkState
from carpool.stats import Outcome
from tests.unit.batching.fakes import EchoModel, ThreadPool


class Harness:
    """A batcher on a fake clock, stepped like the runtime steps it, with the
    invariants checked after every step."""

    def __init__(self, config: BatchingConfig, model: EchoModel | None = None) -> None:
        self.clock = FakeClock()
        self.model = model or EchoModel()
        self.batcher = DynamicBatcher("echo", self.model, config, clock=self.clock)
        self.wakeups = 0
        self.batcher.attach(self._notify)
        self.futures: list[Future[int]] = []

    def _notify(self) -> None:
        self.wakeups += 1

    def submit(self, value: int, **kwargs: object) -> Future[int]:
        future = self.batcher.submit(value, cost=value, **kwargs)  # type: ignore[arg-type]
        self.futures.append(future)
        return future

    def step(self) -> bool:
        """One runtime turn; True if a batch ran."""
        state = self.batcher.poll(self.clock.now())
        ran = state.ready_since is not None
        if ran:
            self.batcher.run_once(self.clock.now())
        self.check()
        return ran

    def check(self) -> None:
        queued = len(self.batcher._queues)
        snapshot = self.batcher.stats.snapshot()
        assert snapshot.pending == queued == self.batcher._admission.total()
        done = sum(f.done() for f in self.futures)
        ended = sum(v for o, v in snapshot.outcomes.items() if o is not Outcome.REJECTED)
        assert done == ended, "every finished future has exactly one recorded outcome"
        assert done + queued == len(self.futures), "every request is queued or finished"


def test_requests_waiting_when_the_device_is_free_run_as_one_batch() -> None:
    h = Harness(BatchingConfig())
    futures = [h.submit(v) for v in (1, 2, 3)]
    assert h.step()
    assert [f.result() for f in futures] == [2, 4, 6]
    assert h.model.batches == [[1, 2, 3]]
    stats = h.batcher.stats.snapshot()
    assert stats.execution_count == 1 and stats.inference_count == 3
    assert stats.batch_sizes[3].compute_infer.count == 1


def test_queue_delay_is_measured_from_the_oldest_request() -> None:
    # Binary fractions keep the fake times exact.
    h = Harness(BatchingConfig(max_queue_delay_ms=125))
    first = h.submit(1)
    h.clock.advance(0.0625)
    second = h.submit(2)
    assert not h.step()
    h.clock.advance(0.03125)
    assert not h.step()
    h.clock.advance(0.03125)
    assert h.step()
    assert first.result() == 2 and second.result() == 4
    assert h.model.batches == [[1, 2]]


def test_a_request_that_arrives_after_the_runtime_read_its_clock_waited_no_time() -> None:
    # The runtime reads the clock, then drains the inbox: a request submitted in
    # between carries a later arrival than that turn's ``now``. Triton's statistics
    # are unsigned, so a negative wait broke gRPC's statistics call (CI, stop 55).
    h = Harness(BatchingConfig())
    turn_began = h.clock.now()
    h.clock.advance(0.25)
    future = h.submit(1)
    assert h.batcher.poll(turn_began).ready_since is not None
    h.batcher.run_once(turn_began)
    assert future.result() == 2
    stats = h.batcher.stats.snapshot()
    assert stats.queue.count == 1 and stats.queue.ns == 0
    assert stats.success.ns >= 0


def test_max_batch_size_splits_the_waiting_requests() -> None:
    h = Harness(BatchingConfig(max_batch_size=2))
    for v in range(1, 6):
        h.submit(v)
    while h.step():
        pass
    assert [len(b) for b in h.model.batches] == [2, 2, 1]


def test_token_budget_limits_a_batch() -> None:
    h = Harness(BatchingConfig(max_batch_tokens=10))
    for v in (6, 3, 4, 1):
        h.submit(v)
    while h.step():
        pass
    assert all(sum(b) <= 10 or len(b) == 1 for b in h.model.batches)
    assert sorted(x for b in h.model.batches for x in b) == [1, 3, 4, 6]


def test_higher_priority_runs_first() -> None:
    h = Harness(BatchingConfig(max_batch_size=1, priority_levels=2, default_priority_level=2))
    low = h.submit(1)
    high = h.submit(2, level=1)
    h.step()
    assert high.done() and not low.done()
    h.step()
    assert low.result() == 2


def test_full_queue_refuses_at_once_with_overloaded() -> None:
    h = Harness(BatchingConfig(queue_policy=QueuePolicy(max_queue_size=2), max_queue_delay_ms=1000))
    h.submit(1)
    h.submit(2)
    with pytest.raises(Overloaded) as err:
        h.submit(3)
    assert err.value.retry_after_s > 0
    assert h.batcher.stats.snapshot().outcomes[Outcome.REJECTED] == 1
    assert not h.step()


def test_request_still_queued_at_its_deadline_times_out_and_never_runs() -> None:
    h = Harness(
        BatchingConfig(max_queue_delay_ms=10_000, queue_policy=QueuePolicy(default_timeout_s=1.0))
    )
    slow = h.submit(1)
    quick = h.submit(2, timeout_s=0.5)
    h.clock.advance(0.5)
    assert not h.step()
    with pytest.raises(QueueTimeout):
        quick.result()
    assert not slow.done()
    h.clock.advance(0.5)
    h.step()
    with pytest.raises(QueueTimeout):
        slow.result()
    assert h.model.batches == []
    assert h.batcher.stats.snapshot().outcomes[Outcome.TIMEOUT] == 2


def test_a_deadline_expires_only_the_requests_a_batch_leaves_behind() -> None:
    h = Harness(BatchingConfig(max_batch_size=1))
    first = h.submit(1, timeout_s=0.5)
    second = h.submit(2, timeout_s=0.5)
    h.clock.advance(0.5)
    assert h.step()
    assert first.result() == 2
    with pytest.raises(QueueTimeout):
        second.result()
    assert h.model.batches == [[1]]


def test_a_request_may_only_shorten_its_timeout_and_only_if_allowed() -> None:
    h = Harness(
        BatchingConfig(max_queue_delay_ms=10_000, queue_policy=QueuePolicy(default_timeout_s=1.0))
    )
    longer = h.submit(1, timeout_s=60.0)
    h.clock.advance(1.0)
    h.step()
    with pytest.raises(QueueTimeout):
        longer.result()
    strict = Harness(BatchingConfig(queue_policy=QueuePolicy(allow_timeout_override=False)))
    with pytest.raises(InvalidRequest):
        strict.submit(1, timeout_s=0.5)


def test_cancelled_request_is_dropped_before_it_runs() -> None:
    h = Harness(BatchingConfig(max_queue_delay_ms=100))
    gone = h.submit(1)
    kept = h.submit(2)
    wakeups = h.wakeups
    assert gone.cancel()
    assert h.wakeups > wakeups, "cancelling wakes the runtime"
    h.clock.advance(0.1)
    assert h.step()
    assert kept.result() == 4
    assert h.model.batches == [[2]]
    assert h.batcher.stats.snapshot().outcomes[Outcome.CANCELLED] == 1


def test_a_poisoned_request_fails_alone_and_its_neighbours_succeed() -> None:
    h = Harness(BatchingConfig(), EchoModel(poison={5}))
    futures = {v: h.submit(v) for v in range(1, 9)}
    assert h.step()
    with pytest.raises(ModelExecutionError) as err:
        futures[5].result()
    # The model's own error, as Triton reports it: its class and text, no stack trace.
    assert err.value.message == "model 'echo' failed: ValueError: poisoned input [5]"
    assert {v: f.result() for v, f in futures.items() if v != 5} == {
        v: 2 * v for v in futures if v != 5
    }
    stats = h.batcher.stats.snapshot()
    assert stats.outcomes[Outcome.ERROR] == 1 and stats.outcomes[Outcome.SUCCESS] == 7
    # The whole batch failed, then halves until the poisoned input stood alone.
    assert h.model.batches[0] == list(range(1, 9)) and [5] in h.model.batches


def test_fail_all_ends_every_queued_request() -> None:
    h = Harness(BatchingConfig(max_queue_delay_ms=10_000))
    futures = [h.submit(v) for v in (1, 2)]
    h.batcher.fail_all(RuntimeError("stopping"))
    assert all(isinstance(f.exception(), RuntimeError) for f in futures)
    assert len(h.batcher._queues) == 0 and h.batcher._admission.total() == 0


def test_random_mix_of_arrivals_cancels_and_timeouts_loses_nothing() -> None:
    import random

    rng = random.Random(7)
    h = Harness(
        BatchingConfig(
            max_queue_delay_ms=20,
            max_batch_size=5,
            queue_policy=QueuePolicy(max_queue_size=30, default_timeout_s=0.05),
        ),
        EchoModel(poison={13}),
    )
    for _ in range(400):
        action = rng.random()
        if action < 0.5:
            with contextlib.suppress(Overloaded):
                h.submit(rng.randint(1, 20), timeout_s=rng.choice([None, 0.01, 0.03]))
        elif action < 0.6 and h.futures:
            rng.choice(h.futures).cancel()
        else:
            h.clock.advance(rng.random() * 0.02)
            h.step()
    h.clock.advance(1.0)
    while h.step():
        pass
    assert all(f.done() for f in h.futures)


def stepper(batcher: DynamicBatcher, clock: FakeClock) -> Callable[[bool], WorkState]:
    """Poll until the batcher has a batch ready (or, ``ready`` false, is idle), waiting
    for its wake-ups in between."""
    woken = threading.Event()
    batcher.attach(woken.set)

    def next_state(ready: bool) -> WorkState:
        for _ in range(1000):
            state = batcher.poll(clock.now())
            if (state.ready_since is not None) if ready else state == IDLE:
                return state
            assert woken.wait(30)
            woken.clear()
        raise AssertionError("the batcher never got there")

    return next_state


def test_a_batcher_on_instances_runs_up_to_one_batch_each_at_once() -> None:
    gates = {v: threading.Event() for v in (1, 2, 3)}
    started: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    class Gated(EchoModel):
        def forward(self, batch: list[int]) -> list[int]:
            started.put(batch)
            assert gates[batch[0]].wait(30)
            return super().forward(batch)

    clock = FakeClock()
    model = Gated()
    pool = ThreadPool(2, model.forward)
    batcher = DynamicBatcher(
        "gated", model, BatchingConfig(max_batch_size=1), clock=clock, instances=pool
    )
    next_state = stepper(batcher, clock)
    futures = [batcher.submit(v, v) for v in (1, 2, 3)]
    for _ in range(2):
        next_state(True)
        batcher.run_once(clock.now())
    assert sorted([started.get(timeout=30), started.get(timeout=30)]) == [[1], [2]]
    held = batcher.poll(clock.now())  # both instances hold a batch: the third waits
    assert held.busy and held.ready_since is None and started.empty()
    gates[2].set()
    assert futures[1].result(timeout=30) == 4
    next_state(True)
    batcher.run_once(clock.now())
    assert started.get(timeout=30) == [3]
    gates[3].set()
    gates[1].set()
    assert [f.result(timeout=30) for f in futures] == [2, 4, 6]
    next_state(False)  # idle only once no batch runs anywhere
    assert pool.free == {0, 1}
    batcher.close("gone")
    with pytest.raises(ModelNotFound):
        batcher.submit(4, 4)


def test_a_batcher_on_instances_is_busy_while_a_batch_runs_with_none_waiting() -> None:
    gate, started = threading.Event(), threading.Event()

    class Gated(EchoModel):
        def forward(self, batch: list[int]) -> list[int]:
            started.set()
            assert gate.wait(30)
            return super().forward(batch)

    model = Gated()
    clock = FakeClock()
    batcher = DynamicBatcher(
        "gated", model, BatchingConfig(), clock=clock, instances=ThreadPool(2, model.forward)
    )
    assert batcher.venue is Venue.INSTANCES
    assert DynamicBatcher("own", model, BatchingConfig()).venue is Venue.RUNTIME_THREAD
    next_state = stepper(batcher, clock)
    future = batcher.submit(1, 1)
    assert batcher.poll(0.0).ready_since is not None
    batcher.run_once(0.0)
    assert started.wait(30)
    running = batcher.poll(0.0)  # nothing queued, but not idle: a retiring runtime waits
    assert running.busy and running.ready_since is None
    gate.set()
    assert future.result(timeout=30) == 2
    next_state(False)


def test_a_bug_in_a_batch_on_an_instance_fails_that_batch_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = EchoModel()
    pool = ThreadPool(2, model.forward)
    clock = FakeClock()
    batcher = DynamicBatcher("buggy", model, BatchingConfig(), clock=clock, instances=pool)
    next_state = stepper(batcher, clock)

    def bug(batch: list[Any], forward: Any, out: list[Any]) -> None:
        raise AssertionError("a bug outside the model")

    monkeypatch.setattr(batcher, "_run_isolating", bug)
    future = batcher.submit(1, 1)
    assert batcher.poll(0.0).ready_since is not None
    batcher.run_once(0.0)
    with pytest.raises(ModelExecutionError, match="AssertionError: a bug outside the model"):
        future.result(timeout=30)
    next_state(False)
    assert pool.free == {0, 1}  # its instance came back
    batcher.close("gone")


def test_a_batch_past_the_timeout_fails_and_its_instance_is_abandoned_not_waited_on() -> None:
    """The runtime thread never waits on an instance: a hung batch is failed when its
    timeout passes, the next batch goes to another instance, and the hung one's late
    answer changes nothing."""
    hung, late = threading.Event(), threading.Event()

    class Hangs(EchoModel):
        def forward(self, batch: list[int]) -> list[int]:
            if batch == [7]:
                assert hung.wait(30)
                late.set()
            return super().forward(batch)

    model = Hangs()
    pool = ThreadPool(2, model.forward, timeout_s=5.0)
    clock = FakeClock()
    batcher = DynamicBatcher(
        "hangs", model, BatchingConfig(max_batch_size=1), clock=clock, instances=pool
    )
    next_state = stepper(batcher, clock)
    stuck = batcher.submit(7, 7)
    next_state(True)
    start = clock.now()
    batcher.run_once(start)
    waiting = batcher.poll(clock.now())
    assert waiting.busy and waiting.wake_at == start + 5.0  # woken when the timeout passes
    clock.advance(5.0)
    assert batcher.poll(clock.now()) == IDLE
    with pytest.raises(BatchFailed, match="execution timeout of 5s; instance 0 is being"):
        stuck.result(timeout=0)
    assert pool.abandoned == [0] and pool.free == {1}
    fine = batcher.submit(2, 2)
    next_state(True)
    batcher.run_once(clock.now())
    assert fine.result(timeout=30) == 4
    next_state(False)
    hung.set()
    assert late.wait(30)
    next_state(False)
    with pytest.raises(BatchFailed):
        stuck.result(timeout=0)  # the late answer did not replace the failure
    assert pool.free == {1}  # the abandoned instance is the pool's to replace
    snapshot = batcher.stats.snapshot()
    assert snapshot.fail.count == 1 and snapshot.success.count == 1


def test_an_instance_is_landed_before_its_answer_is_given() -> None:
    """A client that sends its next request on an answer must find the instance
    free: the answer is given only after the instance is handed back."""
    model = EchoModel()
    pool = ThreadPool(1, model.forward)
    batcher = DynamicBatcher("m", model, BatchingConfig(), clock=FakeClock(), instances=pool)
    landed_when_answered: list[int] = []
    first = batcher.submit(1, 1)
    first.add_done_callback(lambda _: landed_when_answered.append(batcher._landed.qsize()))
    assert batcher.poll(0.0).ready_since is not None
    batcher.run_once(0.0)
    first.result(timeout=30)
    assert landed_when_answered == [1]
    batcher.submit(2, 1)
    assert batcher.poll(0.0).ready_since is not None  # its one instance is free again
