"""The device runtime: one thread owns the device and runs one unit of work at a time.

After hivemind's Runtime. Workers (a dynamic batcher, a generation engine) register
with the runtime. On every turn the runtime polls each worker; among those with work
ready it runs the one of the best (lowest) rank, and among equals the one
whose work has been ready longest. With nothing ready it sleeps until the earliest
time a worker asked to be polled again, or until a worker calls ``notify()``.

The runtime thread never awaits anything; workers hand results back to the event
loop through futures. Nothing a request carries may stop the runtime: an
``Exception`` escaping a worker's ``poll`` or ``run_once`` is contained, the worker
fails the requests it holds (``recover``) and the runtime goes on with every worker.
Only a ``BaseException`` (or a ``recover`` that itself fails) kills the runtime:
then every worker fails its outstanding requests and ``on_death`` is called.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from carpool.clock import Clock, MonotonicClock
from carpool.errors import ModelExecutionError, RuntimeDead, ServerShuttingDown
from carpool.stats import RuntimeStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkState:
    """What a worker tells the runtime when polled.

    ``ready_since``: when its current unit of work became ready, or None if none is.
    ``wake_at``: when to poll again even if nothing is notified (a queue delay or a
    deadline running out), or None.
    ``busy``: work of it runs off the runtime thread (concurrent model instances): it
    is not idle, though nothing of it is ready here.
    """

    ready_since: float | None = None
    wake_at: float | None = None
    busy: bool = False


IDLE = WorkState()


class Venue(StrEnum):
    """Where a worker's model code runs."""

    RUNTIME_THREAD = "runtime thread"
    """On the runtime's thread, in ``run_once``: carpool's own models, one unit at a
    time, so two never fight for the cores."""
    INSTANCES = "instances"
    """On the model's instances (a thread each, or a worker process behind it): user
    code. ``run_once`` hands a batch to a free instance and returns; the worker is
    ``busy`` while batches run there (``carpool.batching.instances``)."""
    ENGINE_PROCESS = "engine process"
    """In a process of its own (a generation engine; the GPU's default): the worker is
    ``busy`` while it holds requests and never ready here, so ``run_once`` is never
    called; the runtime only retires it once idle and fails it with the rest."""


class Worker(Protocol):
    """A model frontend the runtime can drive."""

    name: str
    # Its place in the runtime's order among the workers with work ready (lower runs
    # first): not a request's priority, which orders requests inside one worker.
    rank: int
    venue: Venue

    def attach(self, notify: Callable[[], None]) -> None:
        """Receive the function that wakes the runtime; call it when work arrives."""

    def poll(self, now: float) -> WorkState:
        """Take in new work and report readiness. Runs on the runtime thread."""

    def run_once(self, now: float) -> None:
        """Run one unit of work (a batch, an engine step). Runs on the runtime thread.

        Model failures are the worker's to contain, request by request; an exception
        escaping here (a bug) makes the runtime call ``recover``.
        """

    def recover(self, error: Exception) -> None:
        """``poll`` or ``run_once`` raised: end every request this worker holds with
        ``error`` and return to an empty, usable state. Runs on the runtime thread;
        an exception escaping here kills the runtime."""

    def fail_all(self, error: Exception) -> None:
        """Finish every outstanding request with ``error``; the runtime is stopping."""


class DeviceRuntime:
    """Runs registered workers' units of work on one thread."""

    def __init__(
        self,
        clock: Clock | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        name: str = "carpool-runtime",
    ) -> None:
        self._clock = clock or MonotonicClock()
        self._on_death = on_death
        self._workers: list[Worker] = []
        # Workers added, removed or retired while running; the runtime thread applies them.
        self._changes: queue.SimpleQueue[tuple[Worker, Future[None] | None, bool]] = (
            queue.SimpleQueue()
        )
        self._retiring: dict[Worker, list[Future[None]]] = {}  # runtime thread only
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.error: BaseException | None = None
        self.stats = RuntimeStats()

    def register(self, worker: Worker) -> None:
        """Add a worker; only before ``start``."""
        if self._thread.is_alive():
            raise RuntimeError("register workers before starting the runtime")
        self._attach(worker)
        self._workers.append(worker)

    def add(self, worker: Worker) -> None:
        """Add a worker while running (a model loaded at runtime); any thread. It is
        polled from the runtime's next turn on."""
        self._attach(worker)
        self._changes.put((worker, None, False))
        self.notify()

    def _attach(self, worker: Worker) -> None:
        """Say where ``worker`` runs its model code; hand it the runtime's wake-up."""
        log.info("%s runs on the %s", worker.name, worker.venue)
        worker.attach(self.notify)

    def remove(self, worker: Worker) -> Future[None]:
        """Stop driving ``worker`` (a model unloaded); any thread. The returned future
        is done once the runtime thread has dropped it: no unit of it runs after that.
        The caller drains the worker first; anything still queued in it stays there."""
        return self._drop_later(worker, when_idle=False)

    def retire(self, worker: Worker) -> Future[None]:
        """Drop ``worker`` once it is idle (a model unloaded with its requests
        finishing): it keeps running its queued and running work, and the returned
        future is done on the first turn that finds it with none; no unit of it runs
        after that. Any thread. The caller stops new work reaching it first, and fails
        whatever lands in it after (``fail_all``)."""
        return self._drop_later(worker, when_idle=True)

    def _drop_later(self, worker: Worker, when_idle: bool) -> Future[None]:
        done: Future[None] = Future()
        if not self._thread.is_alive():
            if worker in self._workers:
                self._workers.remove(worker)
            done.set_result(None)
            return done
        self._changes.put((worker, done, when_idle))
        self.notify()
        return done

    @property
    def workers(self) -> list[str]:
        """Names of the workers driven now (a snapshot)."""
        return [w.name for w in list(self._workers)]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """Wake the runtime; any thread may call this."""
        self._wakeup.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current unit of work and fail what is left."""
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _main(self) -> None:
        try:
            while not self._stopping.is_set():
                self._turn()
        except BaseException as exc:
            self.error = exc
            log.exception("device runtime died; failing all outstanding requests")
            self._fail_all(RuntimeDead("the device runtime stopped"))
            if self._on_death is not None:
                self._on_death(exc)
            return
        self._fail_all(ServerShuttingDown("the server is shutting down"))

    def _turn(self) -> None:
        # Clear before polling: a notify that lands after the poll keeps the event
        # set, so the wait below returns at once instead of missing the work.
        self._wakeup.clear()
        self._apply_changes()
        now = self._clock.now()
        best, wake_at = self._poll_all(now)
        if best is not None:
            try:
                best.run_once(now)
            except Exception as exc:
                self._contain(best, exc)
            self.stats.record_unit(best.name, self._clock.now() - now)
            return
        timeout = None if wake_at is None else max(0.0, wake_at - self._clock.now())
        self._wakeup.wait(timeout)

    def _poll_all(self, now: float) -> tuple[Worker | None, float | None]:
        """Poll every worker (dropping retired ones that are idle): the one to run
        now, if any, and the earliest time one asked to be polled again. Its own
        function so that no worker stays referenced while the runtime sleeps."""
        best: tuple[int, float, Worker] | None = None
        wake_at: float | None = None
        for worker in list(self._workers):
            try:
                state = worker.poll(now)
            except Exception as exc:
                self._contain(worker, exc)
                continue
            if state == IDLE and worker in self._retiring:
                self._drop(worker)
                continue
            if state.ready_since is not None:
                key = (worker.rank, state.ready_since)
                if best is None or key < best[:2]:
                    best = (*key, worker)
            if state.wake_at is not None:
                wake_at = state.wake_at if wake_at is None else min(wake_at, state.wake_at)
        return (None if best is None else best[2]), wake_at

    def _apply_changes(self) -> None:
        while True:
            try:
                worker, done, when_idle = self._changes.get_nowait()
            except queue.Empty:
                return
            if done is None:
                self._workers.append(worker)
            elif worker not in self._workers:
                done.set_result(None)
            else:
                self._retiring.setdefault(worker, []).append(done)
                if not when_idle:
                    self._drop(worker)

    def _drop(self, worker: Worker) -> None:
        self._workers.remove(worker)
        for done in self._retiring.pop(worker):
            done.set_result(None)

    def _contain(self, worker: Worker, exc: Exception) -> None:
        log.error("worker %s failed; failing the requests it holds", worker.name, exc_info=exc)
        worker.recover(ModelExecutionError(f"model {worker.name!r} failed on this request"))

    def _fail_all(self, error: Exception) -> None:
        for worker in self._workers:
            try:
                worker.fail_all(error)
            except Exception:
                log.exception("worker %s failed to fail its requests", worker.name)
        for waiting in self._retiring.values():
            for done in waiting:
                done.set_result(None)
        self._retiring.clear()
