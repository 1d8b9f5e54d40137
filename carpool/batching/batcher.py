"""The dynamic batcher: a runtime worker that forms batches from waiting requests.

Threads: ``submit`` runs on any thread (the event loop); it only admits the request
(a counted slot per priority level) and posts it to the inbox. Everything else, the
queues included, belongs to the runtime thread, which drains the inbox in ``poll``.

With ``concurrency`` above 1 (a model with that many instances that may run at
once, Triton's ``instance_group`` count), the runtime thread forms the batch and
hands it to one of as many dispatch threads, which runs it (isolating failures as
the runtime thread would) and reports back through a queue the runtime drains; at
most ``concurrency`` batches run at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Protocol

from carpool.batching.policy import Decision, SendBatch, WaitUntil, decide, slots
from carpool.batching.queue import PriorityQueues
from carpool.batching.request import BatchRequest, Failed
from carpool.clock import Clock, MonotonicClock
from carpool.config import BatchingConfig
from carpool.errors import (
    BatchFailed,
    CarpoolError,
    InvalidRequest,
    ModelExecutionError,
    ModelNotFound,
    Overloaded,
    QueueTimeout,
    RequestTooLarge,
)
from carpool.runtime import IDLE, WorkState
from carpool.stats import BatcherStats, Outcome

log = logging.getLogger(__name__)


class BatchModel(Protocol):
    """A model that maps a batch of inputs to a batch of outputs, in three phases.

    ``ragged``: the model takes its batch concatenated without padding, so the token
    budget counts the sum of lengths rather than the padded size.
    """

    ragged: bool

    def collate(self, payloads: list[Any]) -> Any:
        """Turn the requests' payloads into one batch input."""

    def forward(self, batch: Any) -> Any:
        """Run the model on the batch."""

    def split(self, output: Any, count: int) -> list[Any]:
        """Cut the batch output into one result per request, in order."""


class _Admission:
    """Counts queued inputs per level so ``submit`` can refuse at once when full.

    A request's inputs are admitted all together or not at all, so a refused request
    leaves nothing behind that would crowd out its neighbours.
    """

    def __init__(self, config: BatchingConfig) -> None:
        self._lock = threading.Lock()
        self._limits = {
            lvl: config.policy_for(lvl).max_queue_size
            for lvl in range(1, config.priority_levels + 1)
        }
        self._counts = dict.fromkeys(self._limits, 0)

    def try_acquire(self, level: int, count: int = 1) -> bool:
        with self._lock:
            if self._counts[level] + count > self._limits[level]:
                return False
            self._counts[level] += count
            return True

    def release(self, level: int) -> None:
        with self._lock:
            self._counts[level] -= 1

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class DynamicBatcher:
    """Batches requests for one ``BatchModel`` and runs them on the device runtime."""

    def __init__(
        self,
        name: str,
        model: BatchModel,
        config: BatchingConfig,
        *,
        priority: int = 0,
        clock: Clock | None = None,
        concurrency: int = 1,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.name = name
        self.priority = priority
        self.model = model
        self.config = config
        self.stats = BatcherStats()
        self._clock = clock or MonotonicClock()
        self._admission = _Admission(config)
        self._inbox: queue.SimpleQueue[BatchRequest] = queue.SimpleQueue()
        self._queues = PriorityQueues(config.priority_levels)
        self._notify: Callable[[], None] = lambda: None
        self._decision: SendBatch | None = None
        self._running: list[BatchRequest] = []  # the batch run_once is running
        # Held from the closed check to the inbox put, so nothing lands after ``close``.
        self._entry = threading.Lock()
        self._closed: str | None = None
        self.concurrency = concurrency
        self._dispatch: _Dispatch | None = None  # started with the first concurrent batch
        self._busy = 0  # batches on dispatch threads (runtime thread only)
        self._finished: queue.SimpleQueue[None] = queue.SimpleQueue()

    # --- any thread -------------------------------------------------------------

    def attach(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def max_request_inputs(self, level: int | None = None) -> int:
        """Most inputs one request may bring: half of its level's queue."""
        level = self.config.default_priority_level if level is None else level
        return max(1, self.config.policy_for(level).max_queue_size // 2)

    def submit(
        self,
        payload: Any,
        cost: int,
        *,
        level: int | None = None,
        timeout_s: float | None = None,
        size: int = 1,
        group: Hashable | None = None,
    ) -> Future[Any]:
        """Queue one input; its future ends with the output or a ``CarpoolError``.
        ``size``: batch slots it takes; ``group``: only inputs of equal group share a
        batch (``BatchRequest``). Raises as ``submit_many``."""
        return self.submit_many(
            [(payload, cost)], level=level, timeout_s=timeout_s, size=size, group=group
        )[0]

    def submit_many(
        self,
        inputs: list[tuple[Any, int]],
        *,
        level: int | None = None,
        timeout_s: float | None = None,
        size: int = 1,
        group: Hashable | None = None,
    ) -> list[Future[Any]]:
        """Queue one request's inputs (payload, cost) all together; one future each.

        Raises before anything is queued: ``InvalidRequest`` for a bad level or
        timeout, ``RequestTooLarge`` for more inputs than ``max_request_inputs``,
        ``Overloaded`` when the level's queue has no room for all of them, and
        ``ModelNotFound`` once the batcher is closed.
        """
        level = self.config.default_priority_level if level is None else level
        if not 1 <= level <= self.config.priority_levels:
            raise InvalidRequest(
                f"priority must be between 1 and {self.config.priority_levels}", param="priority"
            )
        policy = self.config.policy_for(level)
        timeout = policy.default_timeout_s
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidRequest("timeout must be > 0", param="timeout")
            if not policy.allow_timeout_override:
                raise InvalidRequest(
                    "this model does not accept a per-request timeout", param="timeout"
                )
            timeout = min(timeout, timeout_s)
        most = self.max_request_inputs(level)
        if len(inputs) > most:
            raise RequestTooLarge(
                f"{len(inputs)} inputs in one request; model {self.name!r} takes at most "
                f"{most} per request",
                param="input",
            )
        with self._entry:
            if self._closed is not None:
                raise ModelNotFound(self._closed, param="model")
            if not self._admission.try_acquire(level, len(inputs)):
                for _ in inputs:
                    self.stats.record_outcome(Outcome.REJECTED, 0.0)
                raise Overloaded(
                    f"model {self.name!r} has too many requests waiting", retry_after_s=1.0
                )
            now = self._clock.now()
            requests = [
                BatchRequest(
                    payload,
                    cost,
                    level,
                    arrival=now,
                    deadline=now + timeout,
                    size=size,
                    group=group,
                )
                for payload, cost in inputs
            ]
            for request in requests:
                # A cancelled future wakes the runtime so the request leaves the queue
                # promptly.
                request.future.add_done_callback(self._wake_if_cancelled)
                self._inbox.put(request)
        self.stats.set_pending(self._admission.total())
        self._notify()
        return [r.future for r in requests]

    def close(self, reason: str) -> None:
        """Take no more requests (``ModelNotFound`` saying ``reason``) and fail those
        still queued with it. Any thread, once the runtime no longer drives this
        batcher (``DeviceRuntime.retire``)."""
        with self._entry:
            self._closed = reason
        self.fail_all(ModelNotFound(reason, param="model"))
        if self._dispatch is not None:
            self._dispatch.stop()

    def _wake_if_cancelled(self, future: Future[Any]) -> None:
        if future.cancelled():
            self._notify()

    # --- runtime thread -----------------------------------------------------------

    def poll(self, now: float) -> WorkState:
        if self._busy == 0 and self._inbox.empty() and not self._queues:
            # Nothing waits, nothing runs: the turn after every batch at low load, in
            # the time a request's result waits for this thread to give up the GIL.
            self._decision = None
            return IDLE
        self._drain_inbox()
        self._drop_cancelled(now)
        self._decision = None
        while not self._finished.empty():
            self._finished.get_nowait()
            self._busy -= 1
        if self._busy >= self.concurrency:  # every instance runs a batch: only expire
            self._expire(now, [])
            return WorkState(wake_at=self._queues.earliest_deadline(), busy=True)
        decision = self._decide(now)
        # A deadline expires only the requests this chance to run passes by (held back
        # by the queue delay or left out of the batch): one that finds the model idle
        # runs, however short its timeout.
        spared = decision.requests if isinstance(decision, SendBatch) else []
        if self._expire(now, spared) and not spared:
            decision = self._decide(now)
        deadline = self._queues.earliest_deadline()
        busy = self._busy > 0
        if decision is None:
            return WorkState(busy=True) if busy else IDLE
        if isinstance(decision, WaitUntil):
            wake = decision.time if deadline is None else min(decision.time, deadline)
            return WorkState(ready_since=None, wake_at=wake, busy=busy)
        self._decision = decision
        ready = min(r.arrival for r in decision.requests)
        return WorkState(ready_since=ready, wake_at=deadline, busy=busy)

    def run_once(self, now: float) -> None:
        if self._decision is None:
            return
        batch = self._decision.requests
        self._decision = None
        self._queues.remove(batch)
        for request in batch:
            self._admission.release(request.level)
        self.stats.set_pending(self._admission.total())
        live = [r for r in batch if r.future.set_running_or_notify_cancel()]
        for request in batch:
            if request not in live:
                self.stats.record_outcome(Outcome.CANCELLED, now - request.arrival)
        for request in live:
            self.stats.record_queue(now - request.arrival)
        if not live:
            return
        if self.concurrency > 1:
            if self._dispatch is None:
                self._dispatch = _Dispatch(f"carpool-{self.name}", self.concurrency)
            self._busy += 1
            self._dispatch.run(self._run_concurrently, live)
            return
        self._running = live
        self._run_isolating(live)
        self._running = []

    def _run_concurrently(self, batch: list[BatchRequest]) -> None:
        """A dispatch thread's part: run ``batch``, then tell the runtime thread. A bug
        escaping the isolation fails what of the batch is left (the runtime thread's
        ``recover`` cannot see it here)."""
        try:
            self._run_isolating(batch)
        except Exception as exc:
            log.error("running a batch of %s failed", self.name, exc_info=exc)
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(
                        ModelExecutionError(f"model {self.name!r} failed on this request")
                    )
        finally:
            self._finished.put(None)
            self._notify()

    def recover(self, error: Exception) -> None:
        """A bug escaped ``poll`` or ``run_once``: end the batch that was running and
        every queued request with ``error``; the queues start empty."""
        self._decision = None
        for request in self._running:
            if not request.future.done():
                request.future.set_exception(error)
                self.stats.record_outcome(Outcome.ERROR, 0.0)
        self._running = []
        self.fail_all(error)

    def fail_all(self, error: Exception) -> None:
        self._drain_inbox()
        for request in self._queues.take_if(lambda r: True):
            self._admission.release(request.level)
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(error)
        self.stats.set_pending(self._admission.total())

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._queues.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _drop_cancelled(self, now: float) -> None:
        for request in self._queues.take_if(lambda r: r.future.cancelled()):
            self._admission.release(request.level)
            self.stats.record_outcome(Outcome.CANCELLED, now - request.arrival)
        self.stats.set_pending(self._admission.total())

    def _decide(self, now: float) -> Decision:
        return decide(list(self._queues.in_order()), now, self.config, self.model.ragged)

    def _expire(self, now: float, spared: list[BatchRequest]) -> bool:
        """Time out the queued requests past their deadline but those ``spared``;
        whether there were any."""
        expired = self._queues.take_if(lambda r: r.deadline <= now and r not in spared)
        for request in expired:
            self._admission.release(request.level)
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    QueueTimeout(
                        f"request waited {now - request.arrival:.3f}s in the queue and timed out"
                    )
                )
                self.stats.record_outcome(Outcome.TIMEOUT, now - request.arrival)
            else:
                self.stats.record_outcome(Outcome.CANCELLED, now - request.arrival)
        self.stats.set_pending(self._admission.total())
        return bool(expired)

    def _run_isolating(self, batch: list[BatchRequest]) -> None:
        """Run ``batch``; on a model error re-run it in halves until the failing
        requests are isolated, so only they get the error. A ``BatchFailed`` (the model
        hung or its process died) fails the whole batch: re-running could not isolate
        anything."""
        try:
            outputs = self._execute(batch)
        except BatchFailed as exc:
            for request in batch:
                self._fail(request, exc)
            return
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            log.warning("batch of %d failed on %s; splitting to isolate", len(batch), self.name)
            half = len(batch) // 2
            self._run_isolating(batch[:half])
            self._run_isolating(batch[half:])
            return
        end = self._clock.now()
        for request, output in zip(batch, outputs, strict=True):
            if isinstance(output, Failed):
                self._fail(request, output.error)
                continue
            request.future.set_result(output)
            self.stats.record_outcome(Outcome.SUCCESS, end - request.arrival)

    def _execute(self, batch: list[BatchRequest]) -> list[Any]:
        t0 = self._clock.now()
        collated = self.model.collate([r.payload for r in batch])
        t1 = self._clock.now()
        output = self.model.forward(collated)
        t2 = self._clock.now()
        results = self.model.split(output, len(batch))
        t3 = self._clock.now()
        if len(results) != len(batch):
            raise RuntimeError(f"model returned {len(results)} outputs for {len(batch)} inputs")
        self.stats.record_execution(
            slots(batch), t1 - t0, t2 - t1, t3 - t2, int(time.time() * 1000)
        )
        return results

    def _fail(self, request: BatchRequest, exc: Exception) -> None:
        if isinstance(exc, CarpoolError):
            error: CarpoolError = exc
        else:
            log.error("model %s failed on request %d", self.name, request.id, exc_info=exc)
            error = ModelExecutionError(f"model {self.name!r} failed on this input")
        request.future.set_exception(error)
        self.stats.record_outcome(Outcome.ERROR, self._clock.now() - request.arrival)


class _Dispatch:
    """``count`` daemon threads that run what they are handed (a concurrent batcher's
    batches). Daemons, so a batch hung in user code never holds up the server's exit."""

    def __init__(self, name: str, count: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], Any] | None] = queue.SimpleQueue()
        self._count = count
        for i in range(count):
            threading.Thread(target=self._main, name=f"{name}-{i}", daemon=True).start()

    def run(self, fn: Callable[[Any], None], arg: Any) -> None:
        self._jobs.put((fn, arg))

    def stop(self) -> None:
        """End the threads once they finish what they hold."""
        for _ in range(self._count):
            self._jobs.put(None)

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, arg = job
            try:
                fn(arg)
            except BaseException:
                log.exception("a concurrent batch failed outside its model")
