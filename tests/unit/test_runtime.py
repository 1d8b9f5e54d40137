"""The device runtime picks work by rank then age, contains a worker's failure,
and fails loudly if it dies."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from carpool.clock import FakeClock
from carpool.errors import ModelExecutionError, RuntimeDead
from carpool.runtime import IDLE, DeviceRuntime, Venue, WorkState


class ScriptedWorker:
    """Reports ready with a fixed ``ready_since`` for ``units`` turns, logging runs."""

    def __init__(
        self, name: str, rank: int, ready_since: float, units: int, log: list[str]
    ) -> None:
        self.name = name
        self.rank = rank
        self.venue = Venue.RUNTIME_THREAD
        self.ready_since = ready_since
        self.units = units
        self.log = log
        self.failed_with: Exception | None = None
        self.recovered_with: list[Exception] = []
        self.notify: Callable[[], None] = lambda: None

    def attach(self, notify: Callable[[], None]) -> None:
        self.notify = notify

    def poll(self, now: float) -> WorkState:
        return WorkState(ready_since=self.ready_since) if self.units else IDLE

    def run_once(self, now: float) -> None:
        self.units -= 1
        self.log.append(self.name)

    def fail_all(self, error: Exception) -> None:
        self.failed_with = error

    def recover(self, error: Exception) -> None:
        self.recovered_with.append(error)


def test_best_rank_runs_first_then_the_longest_waiting() -> None:
    log: list[str] = []
    runtime = DeviceRuntime()
    workers = [
        ScriptedWorker("late-urgent", 0, ready_since=5.0, units=1, log=log),
        ScriptedWorker("old", 1, ready_since=1.0, units=1, log=log),
        ScriptedWorker("new", 1, ready_since=2.0, units=1, log=log),
    ]
    for w in workers:
        runtime.register(w)
    for _ in range(3):
        runtime._turn()
    assert log == ["late-urgent", "old", "new"]


def test_stats_count_each_workers_units_and_busy_time() -> None:
    clock = FakeClock()
    log: list[str] = []

    class Slow(ScriptedWorker):
        def run_once(self, now: float) -> None:
            super().run_once(now)
            clock.advance(0.25 if self.name == "chat" else 0.5)

    runtime = DeviceRuntime(clock=clock)
    runtime.register(Slow("chat", 0, ready_since=1.0, units=3, log=log))
    runtime.register(Slow("embed", 0, ready_since=2.0, units=1, log=log))
    for _ in range(4):
        runtime._turn()
    stats = runtime.stats.snapshot()
    assert stats.units == {"chat": 3, "embed": 1}
    assert stats.busy_s == {"chat": 0.75, "embed": 0.5}


def test_runtime_thread_runs_notified_work_and_stops_cleanly() -> None:
    log: list[str] = []
    ran = threading.Event()

    class OneShot(ScriptedWorker):
        def run_once(self, now: float) -> None:
            super().run_once(now)
            ran.set()

    worker = OneShot("w", 0, ready_since=0.0, units=0, log=log)
    runtime = DeviceRuntime()
    runtime.register(worker)
    runtime.start()
    worker.units = 1
    worker.notify()
    assert ran.wait(5.0)
    runtime.stop()
    assert not runtime.alive and log == ["w"]
    assert worker.failed_with is not None  # stopping fails what is left


class Fatal(BaseException):
    """Escapes every ``except Exception``."""


@pytest.mark.parametrize("where", ["poll", "run_once"])
def test_a_worker_exception_is_contained_and_the_others_go_on(where: str) -> None:
    log: list[str] = []

    class Buggy(ScriptedWorker):
        def poll(self, now: float) -> WorkState:
            if where == "poll" and self.units:
                self.units -= 1
                raise RuntimeError("bug in poll")
            return super().poll(now)

        def run_once(self, now: float) -> None:
            self.units -= 1
            raise RuntimeError("bug in run_once")

    runtime = DeviceRuntime()
    buggy = Buggy("bad", 0, ready_since=0.0, units=1, log=log)
    bystander = ScriptedWorker("ok", 5, ready_since=1.0, units=2, log=log)
    runtime.register(buggy)
    runtime.register(bystander)
    for _ in range(2 if where == "poll" else 3):  # a failed poll still lets the others run
        runtime._turn()
    assert [type(e) for e in buggy.recovered_with] == [ModelExecutionError]
    assert log == ["ok", "ok"] and bystander.recovered_with == []
    assert runtime.error is None


@pytest.mark.parametrize("failure", ["base_exception", "recover_fails"])
def test_a_fatal_failure_kills_the_runtime_and_fails_every_worker(failure: str) -> None:
    died = threading.Event()
    seen: list[BaseException] = []

    class Crashing(ScriptedWorker):
        def run_once(self, now: float) -> None:
            raise Fatal("killed") if failure == "base_exception" else RuntimeError("bug")

        def recover(self, error: Exception) -> None:
            raise RuntimeError("cannot recover")

    def on_death(exc: BaseException) -> None:
        seen.append(exc)
        died.set()

    bystander = ScriptedWorker("ok", 5, ready_since=0.0, units=0, log=[])
    crashing = Crashing("bad", 0, ready_since=0.0, units=1, log=[])
    runtime = DeviceRuntime(on_death=on_death)
    runtime.register(crashing)
    runtime.register(bystander)
    runtime.start()
    assert died.wait(5.0)
    assert isinstance(seen[0], Fatal if failure == "base_exception" else RuntimeError)
    assert not runtime.alive
    assert isinstance(bystander.failed_with, RuntimeDead)


def test_a_retired_worker_finishes_its_work_then_leaves() -> None:
    log: list[str] = []
    running, release = threading.Event(), threading.Event()

    class Held(ScriptedWorker):
        def run_once(self, now: float) -> None:
            running.set()
            release.wait()
            super().run_once(now)

    runtime = DeviceRuntime()
    worker = Held("old", 0, ready_since=1.0, units=2, log=log)
    other = ScriptedWorker("other", 0, ready_since=2.0, units=0, log=log)
    runtime.register(worker)
    runtime.register(other)
    runtime.start()
    try:
        running.wait()
        retired = runtime.retire(worker)
        assert not retired.done()  # the runtime thread is inside the worker's first unit
        release.set()
        retired.result(timeout=30)
        assert log == ["old", "old"] and worker.units == 0
        assert runtime.workers == ["other"]
        assert runtime.retire(worker).result(timeout=30) is None  # already gone: at once
    finally:
        runtime.stop()
