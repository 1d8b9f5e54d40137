"""The dynamic batcher: a runtime worker that forms batches from waiting requests.

Threads: ``submit`` runs on any thread (the event loop); it only admits the request
(a counted slot per priority level) and posts it to the inbox. Everything else, the
queues included, belongs to the runtime thread, which drains the inbox in ``poll``.

Where a batch runs is the model's venue (``instances``): on the runtime thread
itself (carpool's own models), or, given an ``InstancePool`` (user code), on a free
instance's own thread: the runtime thread forms the batch, hands it over and moves
on. The instance runs it (isolating failures as the runtime thread would) and
reports back through a queue the runtime drains; a batch still running past the
pool's execution timeout is failed here, on the runtime thread, and its instance
abandoned to the pool, which replaces it. At most one batch runs per instance.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

from carpool.admission import Gate, per_request
from carpool.batching.instances import Forward, InstancePool
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
)
from carpool.runtime import IDLE, Venue, WorkState
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
    """The queued inputs of each priority level, each level's queue admitted under its
    ``max_queue_size`` (``carpool.admission.Gate``)."""

    def __init__(self, name: str, config: BatchingConfig) -> None:
        self._limits = {
            lvl: config.policy_for(lvl).max_queue_size
            for lvl in range(1, config.priority_levels + 1)
        }
        self._gates = {lvl: Gate(f"model {name!r}", "inputs", "input") for lvl in self._limits}

    def admit(self, level: int, count: int) -> None:
        """``Gate.admit``: all ``count`` inputs or an error, nothing admitted."""
        self._gates[level].admit(count, self._limits[level])

    def release(self, level: int) -> None:
        self._gates[level].leave()

    def total(self) -> int:
        return sum(gate.count for gate in self._gates.values())


# A request's answer, computed but not yet given: (request, result, error, when).
_Settlement = tuple[BatchRequest, Any, Exception | None, float]


@dataclass(eq=False)
class _Flight:
    """A batch handed to an instance (runtime thread's record of it)."""

    batch: list[BatchRequest]
    instance: int
    deadline: float | None  # past it the batch fails (None: no execution timeout)


class DynamicBatcher:
    """Batches requests for one ``BatchModel`` and runs them on the device runtime's
    thread, or, given ``instances``, on the model's own instances."""

    def __init__(
        self,
        name: str,
        model: BatchModel,
        config: BatchingConfig,
        *,
        rank: int = 0,
        clock: Clock | None = None,
        instances: InstancePool | None = None,
    ) -> None:
        self.name = name
        self.rank = rank
        self.model = model
        self.config = config
        self.stats = BatcherStats()
        self._clock = clock or MonotonicClock()
        self._admission = _Admission(name, config)
        self._inbox: queue.SimpleQueue[BatchRequest] = queue.SimpleQueue()
        self._queues = PriorityQueues(config.priority_levels)
        self._notify: Callable[[], None] = lambda: None
        self._decision: SendBatch | None = None
        self._running: list[BatchRequest] = []  # the batch run_once is running
        # Held from the closed check to the inbox put, so nothing lands after ``close``.
        self._entry = threading.Lock()
        self._closed: str | None = None
        self.instances = instances
        self.venue = Venue.RUNTIME_THREAD if instances is None else Venue.INSTANCES
        self._flights: dict[int, _Flight] = {}  # by instance (runtime thread only)
        self._landed: queue.SimpleQueue[_Flight] = queue.SimpleQueue()

    # --- any thread -------------------------------------------------------------

    def attach(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        if self.instances is not None:
            self.instances.attach(notify)

    def max_request_inputs(self, level: int | None = None) -> int:
        """Most inputs one request may bring: half of its level's queue."""
        level = self.config.default_priority_level if level is None else level
        return per_request(self.config.policy_for(level).max_queue_size)

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
        with self._entry:
            if self._closed is not None:
                raise ModelNotFound(self._closed, param="model")
            try:
                self._admission.admit(level, len(inputs))
            except Overloaded:
                for _ in inputs:
                    self.stats.record_outcome(Outcome.REJECTED, 0.0)
                raise
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

    def _wake_if_cancelled(self, future: Future[Any]) -> None:
        if future.cancelled():
            self._notify()

    # --- runtime thread -----------------------------------------------------------

    def poll(self, now: float) -> WorkState:
        if not self._flights and self._inbox.empty() and not self._queues:
            # Nothing waits, nothing runs: the turn after every batch at low load, in
            # the time a request's result waits for this thread to give up the GIL.
            self._decision = None
            return IDLE
        self._drain_inbox()
        self._drop_cancelled(now)
        self._decision = None
        self._land_flights()
        self._abandon_overdue(now)
        busy = bool(self._flights)
        if self.instances is not None and not self.instances.has_free():
            # Every instance runs a batch (or is being replaced): only expire.
            self._expire(now, [])
            return WorkState(wake_at=self._earliest_deadline(), busy=busy)
        decision = self._decide(now)
        # A deadline expires only the requests this chance to run passes by (held back
        # by the queue delay or left out of the batch): one that finds the model idle
        # runs, however short its timeout.
        spared = decision.requests if isinstance(decision, SendBatch) else []
        if self._expire(now, spared) and not spared:
            decision = self._decide(now)
        deadline = self._earliest_deadline()
        if decision is None:
            return WorkState(wake_at=deadline, busy=True) if busy else IDLE
        if isinstance(decision, WaitUntil):
            wake = decision.time if deadline is None else min(decision.time, deadline)
            return WorkState(ready_since=None, wake_at=wake, busy=busy)
        self._decision = decision
        ready = min(r.arrival for r in decision.requests)
        return WorkState(ready_since=ready, wake_at=deadline, busy=busy)

    def _earliest_deadline(self) -> float | None:
        """The earliest queued request's deadline or running batch's timeout."""
        times = [f.deadline for f in self._flights.values() if f.deadline is not None]
        queued = self._queues.earliest_deadline()
        if queued is not None:
            times.append(queued)
        return min(times, default=None)

    def _land_flights(self) -> None:
        """Free the instances whose batches came back (an abandoned one's late
        answer changes nothing: its instance is the pool's to replace)."""
        while True:
            try:
                flight = self._landed.get_nowait()
            except queue.Empty:
                return
            if self._flights.get(flight.instance) is flight:
                del self._flights[flight.instance]
                assert self.instances is not None  # flights exist only with instances
                self.instances.give_back(flight.instance)

    def _abandon_overdue(self, now: float) -> None:
        """Fail every batch past its execution timeout and abandon its instance."""
        for flight in [f for f in self._flights.values() if f.deadline and f.deadline <= now]:
            del self._flights[flight.instance]
            assert self.instances is not None
            error = BatchFailed(
                f"model '{self.name}' did not finish a batch within its execution timeout of "
                f"{self.instances.timeout_s:g}s; {self.instances.abandon_note(flight.instance)}"
            )
            log.error("%s", error.message)
            for request in flight.batch:
                self._fail(request, error)
            self.instances.abandon(flight.instance)

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
                self.stats.record_outcome(Outcome.CANCELLED, request.waited(now))
        for request in live:
            self.stats.record_queue(request.waited(now))
        if not live:
            return
        if self.instances is not None:
            self._hand_over(live, now)
            return
        self._running = live
        settlements: list[_Settlement] = []
        self._run_isolating(live, self.model.forward, settlements)
        self._apply(settlements)
        self._running = []

    def _hand_over(self, batch: list[BatchRequest], now: float) -> None:
        """Give ``batch`` to a free instance (``poll`` saw one) and go on."""
        assert self.instances is not None
        index = self.instances.take()
        if index is None:
            raise RuntimeError(f"model {self.name!r} has no free instance for a batch it formed")
        timeout = self.instances.timeout_s
        flight = _Flight(batch, index, now + timeout if timeout > 0 else None)
        self._flights[index] = flight
        self.instances.run(index, lambda forward: self._run_on_instance(flight, forward))

    def _run_on_instance(self, flight: _Flight, forward: Forward) -> None:
        """An instance thread's part: run the batch, tell the runtime thread the
        instance is free, then answer. In that order: a client that sends its next
        request on an answer finds the instance landed, not busy (a request with a
        short timeout timed out in that moment). A bug escaping the isolation fails
        what of the batch is left (the runtime thread's ``recover`` cannot see it)."""
        settlements: list[_Settlement] = []
        try:
            self._run_isolating(flight.batch, forward, settlements)
        except Exception as exc:
            log.error("running a batch of %s failed", self.name, exc_info=exc)
            error = ModelExecutionError(_describe(self.name, exc))
            settlements += [(r, None, error, self._clock.now()) for r in flight.batch]
        finally:
            self._landed.put(flight)
            self._notify()
            self._apply(settlements)

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
            self.stats.record_outcome(Outcome.CANCELLED, request.waited(now))
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
                        f"request waited {request.waited(now):.3f}s in the queue and timed out"
                    )
                )
                self.stats.record_outcome(Outcome.TIMEOUT, request.waited(now))
            else:
                self.stats.record_outcome(Outcome.CANCELLED, request.waited(now))
        self.stats.set_pending(self._admission.total())
        return bool(expired)

    def _run_isolating(
        self, batch: list[BatchRequest], forward: Forward, out: list[_Settlement]
    ) -> None:
        """Run ``batch`` and add each request's answer to ``out``; on a model error
        re-run it in halves until the failing requests are isolated, so only they get
        the error. A ``BatchFailed`` (the model hung or its process died) fails the
        whole batch: re-running could not isolate anything."""
        try:
            outputs = self._execute(batch, forward)
        except BatchFailed as exc:
            out += [(r, None, exc, self._clock.now()) for r in batch]
            return
        except Exception as exc:
            if len(batch) == 1:
                out.append((batch[0], None, exc, self._clock.now()))
                return
            log.warning("batch of %d failed on %s; splitting to isolate", len(batch), self.name)
            half = len(batch) // 2
            self._run_isolating(batch[:half], forward, out)
            self._run_isolating(batch[half:], forward, out)
            return
        end = self._clock.now()
        for request, output in zip(batch, outputs, strict=True):
            error = output.error if isinstance(output, Failed) else None
            out.append((request, None if error else output, error, end))

    def _apply(self, settlements: list[_Settlement]) -> None:
        """Answer each request (once: a request already failed, say by its batch's
        timeout, keeps that answer and is not counted again)."""
        for request, result, error, at in settlements:
            if error is not None:
                self._fail(request, error, at)
            elif _settle(request.future, result=result):
                self.stats.record_outcome(Outcome.SUCCESS, request.waited(at))

    def _execute(self, batch: list[BatchRequest], forward: Forward) -> list[Any]:
        t0 = self._clock.now()
        collated = self.model.collate([r.payload for r in batch])
        t1 = self._clock.now()
        output = forward(collated)
        t2 = self._clock.now()
        results = self.model.split(output, len(batch))
        t3 = self._clock.now()
        if len(results) != len(batch):
            raise RuntimeError(f"model returned {len(results)} outputs for {len(batch)} inputs")
        self.stats.record_execution(
            slots(batch), t1 - t0, t2 - t1, t3 - t2, int(time.time() * 1000)
        )
        return results

    def _fail(self, request: BatchRequest, exc: Exception, at: float | None = None) -> None:
        if isinstance(exc, CarpoolError):
            error: CarpoolError = exc
        else:
            log.error("model %s failed on request %d", self.name, request.id, exc_info=exc)
            error = ModelExecutionError(_describe(self.name, exc))
        if _settle(request.future, error=error):
            end = self._clock.now() if at is None else at
            self.stats.record_outcome(Outcome.ERROR, request.waited(end))


MESSAGE_CHARS = 2000


def _describe(model: str, exc: Exception) -> str:
    """What the client is told of an exception the model raised: its class and
    message, as Triton reports it (no stack trace), bounded in length."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + "..."
    return f"model '{model}' failed: {text}"


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> bool:
    """End ``future`` with ``error`` or ``result`` unless it has ended already (a
    batch that timed out was failed on the runtime thread while its instance still
    ran it); whether this call ended it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True
