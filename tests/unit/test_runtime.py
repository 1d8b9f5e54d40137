"""The device runtime picks work by priority then age, and fails loudly if it dies."""

from __future__ import annotations

import threading
from collections.abc import Callable

from carpool.errors import RuntimeDead
from carpool.runtime import IDLE, DeviceRuntime, WorkState


class ScriptedWorker:
    """Reports ready with a fixed ``ready_since`` for ``units`` turns, logging runs."""

    def __init__(
        self, name: str, priority: int, ready_since: float, units: int, log: list[str]
    ) -> None:
        self.name = name
        self.priority = priority
        self.ready_since = ready_since
        self.units = units
        self.log = log
        self.failed_with: Exception | None = None
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


def test_best_priority_runs_first_then_the_longest_waiting() -> None:
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


def test_a_worker_crash_kills_the_runtime_and_fails_every_worker() -> None:
    died = threading.Event()
    seen: list[BaseException] = []

    class Crashing(ScriptedWorker):
        def run_once(self, now: float) -> None:
            raise RuntimeError("bug in the engine")

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
    assert isinstance(seen[0], RuntimeError)
    assert not runtime.alive
    assert isinstance(bystander.failed_with, RuntimeDead)
