"""The engine on the device runtime, and an asyncio front that streams outputs.

``EngineWorker`` is the runtime's ``Worker`` for a generation engine: any thread
may ``submit`` or ``abort`` (they post to an inbox and wake the runtime); the
runtime thread alone touches the engine: it drains the inbox in ``poll`` and runs
one engine step per ``run_once``, handing each output to its request's sink.

``AsyncEngine.generate`` is the event loop's view: an async iterator of a
request's outputs. Leaving it early (client gone, task cancelled) aborts the
request, whose blocks are free after the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from carpool.admission import RETRY_AFTER_S, Gate
from carpool.clock import Clock, MonotonicClock
from carpool.engine.engine import Engine
from carpool.engine.request_output import RequestOutput
from carpool.engine.sampling_params import Grammar, SamplingParams
from carpool.engine.sequence import FinishReason
from carpool.errors import (
    CarpoolError,
    ModelExecutionError,
    ModelNotFound,
    Overloaded,
    ServerShuttingDown,
)
from carpool.runtime import IDLE, Venue, Worker, WorkState
from carpool.stats import EngineStats

if TYPE_CHECKING:
    from carpool.paths import PathTaken

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | CarpoolError], None]
HALF = " (half of --max-waiting-requests)"  # where a generator's per-request limit comes from


class GenerationWorker(Worker, Protocol):
    """What ``AsyncEngine`` drives: a generation engine as a runtime worker, in this
    process (``EngineWorker``) or in one of its own (``engine_process.EngineClient``).
    Every method but the runtime's may be called from any thread."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        """Which code runs each part of a step (native kernels or torch)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""

    @property
    def stats(self) -> EngineStats: ...

    def new_request_id(self) -> str: ...

    def submit_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams, Sink]],
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        max_waiting: int | None = None,
    ) -> list[list[int]]:
        """As ``EngineWorker.submit_many``."""

    def abort(self, request_id: str) -> None: ...

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile ``grammar`` (cached); raises ``InvalidRequest`` naming ``param``."""

    def close(self, reason: str) -> None:
        """Take no more requests and fail those still held (the model is unloaded)."""


def as_carpool_error(error: Exception) -> CarpoolError:
    """``error`` as requests see it: itself if a ``CarpoolError``, else a model error
    saying what it was."""
    return error if isinstance(error, CarpoolError) else ModelExecutionError(str(error))


class Entry:
    """Whether a worker still takes requests. Hold ``lock`` from ``check`` to the
    hand-over, so nothing lands after closing; once closed, ``check`` raises the
    closing's error. Any thread."""

    def __init__(self, name: str) -> None:
        self.lock = threading.Lock()
        self._name = name
        self._refusal: Callable[[], CarpoolError] | None = None

    def check(self) -> None:
        """Raise the refusal if closed (under ``lock``)."""
        if self._refusal is not None:
            raise self._refusal()

    def close(self, refusal: Callable[[], CarpoolError] | None = None) -> None:
        """Refuse from now on with ``refusal``'s error; with none, say the worker is not
        running (``ServerShuttingDown``) unless it was already closed otherwise."""
        with self.lock:
            if refusal is not None:
                self._refusal = refusal
            elif self._refusal is None:
                name = self._name
                self._refusal = lambda: ServerShuttingDown(f"{name} is not running")


class EngineFront:
    """What both engine front ends (``EngineWorker`` here, ``EngineClient`` before an
    engine process) share on the requests' side: their ids, the entry that closes, and
    the waiting room's admission (``carpool.admission.Gate``: at most
    ``--max-waiting-requests`` accepted and not started, half of it per request).
    Any thread."""

    def __init__(self, name: str, rank: int) -> None:
        self.name = name
        self.rank = rank
        self._ids = itertools.count()
        self._room = Gate(name, "prompts", "prompt")
        self._entry = Entry(name)

    @property
    def num_waiting(self) -> int:
        return self._room.count

    def new_request_id(self) -> str:
        return f"{self.name}-{next(self._ids)}"

    @contextmanager
    def _admitting(self, count: int, max_waiting: int | None) -> Iterator[None]:
        """Admit ``count`` requests (or raise the entry's refusal, ``RequestTooLarge``
        or ``Overloaded``, nothing admitted) and hold the entry for the ``with`` body,
        the hand-over: nothing lands after closing."""
        with self._entry.lock:
            self._entry.check()
            self._room.admit(count, max_waiting, why=HALF)
            yield


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    deadline: float | None
    arrival: float
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineWorker(EngineFront):
    """A generation engine as a device-runtime worker."""

    venue = Venue.RUNTIME_THREAD

    def __init__(
        self,
        engine: Engine,
        name: str,
        rank: int = 0,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(name, rank)
        self.engine = engine
        self.clock = clock or MonotonicClock()
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._notify: Callable[[], None] = lambda: None
        self._sinks: dict[str, Sink] = {}  # runtime thread only
        self._ready_since: float | None = None
        self._started: set[str] = set()  # runtime thread only

    # -- any thread -------------------------------------------------------------------

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        return self.engine.paths

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        return self.engine.blocks.block_size

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        self.engine.runner.compile_grammar(grammar, param)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        max_waiting: int | None = None,
    ) -> list[int]:
        """Accept one request or raise, as ``submit_many``; the prompt as it will run."""
        return self.submit_many(
            [(request_id, prompt_ids, params, sink)],
            priority=priority,
            timeout_s=timeout_s,
            max_waiting=max_waiting,
        )[0]

    def submit_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams, Sink]],
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        max_waiting: int | None = None,
    ) -> list[list[int]]:
        """Accept requests (id, prompt, params, sink) all together, or none: raises
        ``InvalidRequest`` (each checked now, before anything runs), ``RequestTooLarge``
        for more than half of ``max_waiting`` at once, ``Overloaded`` when the waiting
        room has no space for all of them. Returns the prompts as they will run (after
        truncation)."""
        prompts = [self.engine.check_request(p, params) for _, p, params, _ in requests]
        with self._admitting(len(requests), max_waiting):
            now = self.clock.now()
            deadline = None if timeout_s is None else now + timeout_s
            for (request_id, _, params, sink), prompt in zip(requests, prompts, strict=True):
                self._inbox.put(_Add(request_id, prompt, params, priority, deadline, now, sink))
        self._notify()
        return prompts

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        self._notify()

    # -- the runtime thread -------------------------------------------------------------

    def attach(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def poll(self, now: float) -> WorkState:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._take(message)
        if not self.engine.has_work:
            self._ready_since = None
            return IDLE
        if self._ready_since is None:
            self._ready_since = now
        return WorkState(ready_since=self._ready_since)

    def _take(self, message: _Add | _Abort) -> None:
        if isinstance(message, _Abort):
            self.engine.abort(message.request_id)
            return
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_ids,
                message.params,
                priority=message.priority,
                deadline=message.deadline,
                arrival=message.arrival,
            )
        except Exception as exc:
            # Whatever setting the request up raised fails that request alone.
            if not isinstance(exc, CarpoolError):
                log.error("setting up %s failed", message.request_id, exc_info=exc)
                exc = ModelExecutionError(f"model {self.name!r} could not set up this request")
            self._room.leave()
            _deliver(message.sink, exc)
            return
        self._sinks[message.request_id] = message.sink

    def run_once(self, now: float) -> None:
        outputs = self.engine.step()
        # The next turn is ready from now on, so another worker with older work runs
        # first: the runtime alternates fairly between a busy engine and a busy batcher.
        self._ready_since = self.clock.now()
        deliveries: list[tuple[Sink | None, RequestOutput]] = []
        for out in outputs:
            if out.request_id not in self._started:
                self._started.add(out.request_id)
                self._room.leave()
            if out.finished:
                self._started.discard(out.request_id)
                deliveries.append((self._sinks.pop(out.request_id, None), out))
            else:
                deliveries.append((self._sinks.get(out.request_id), out))
        deliver_all(deliveries)

    def recover(self, error: Exception) -> None:
        """A bug escaped the engine: fail every request it holds and start empty."""
        error = as_carpool_error(error)
        finals = self.engine.reset("the engine failed; this request was ended")
        for out in finals:
            if out.request_id not in self._started:
                self._room.leave()
        self._started.clear()
        self._ready_since = None
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            _deliver(sink, error)

    def close(self, reason: str) -> None:
        """Take no more requests (``ModelNotFound`` saying ``reason``) and fail any
        still held with it. Any thread, once the runtime no longer drives this worker
        (``DeviceRuntime.retire``)."""
        self._entry.close(lambda: ModelNotFound(reason, param="model"))
        self.fail_all(ModelNotFound(reason, param="model"))

    def fail_all(self, error: Exception) -> None:
        """End everything held with ``error``; later submits are refused (the runtime
        is stopping, or the model was unloaded)."""
        self._entry.close()
        carpool_error = as_carpool_error(error)
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, _Add):
                message.sink(carpool_error)
        for sink in self._sinks.values():
            sink(carpool_error)
        self._sinks.clear()


def deliver_all(items: Iterable[tuple[Sink | None, RequestOutput | CarpoolError]]) -> None:
    """Hand each item to its sink (None: its request is gone). One wake-up per event
    loop for all of them, not one per request: a step of 64 streams would otherwise
    cost 64 self-pipe writes and loop turns."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[QueueSink, RequestOutput | CarpoolError]]]
    batches = {}
    for sink, item in items:
        if isinstance(sink, QueueSink):
            batches.setdefault(sink.loop, []).append((sink, item))
        elif sink is not None:
            _deliver(sink, item)
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except Exception:  # its loop closed: only its requests lose their outputs
            log.exception("could not deliver %d outputs", len(batch))


def _deliver(sink: Sink, item: RequestOutput | CarpoolError) -> None:
    """Hand ``item`` to its request's sink; a sink that cannot take it (its event
    loop closed) loses only that request's output."""
    try:
        sink(item)
    except Exception:
        log.exception("could not deliver an output")


class AsyncEngine:
    """The event loop's handle on an ``EngineWorker``."""

    def __init__(self, worker: GenerationWorker, max_waiting: int | None = None) -> None:
        self.worker = worker
        self.max_waiting = max_waiting

    @property
    def engine(self) -> Engine:
        """The engine, where it runs in this process (tests and the offline API)."""
        if not isinstance(self.worker, EngineWorker):
            raise TypeError(f"{self.worker.name}'s engine runs in a process of its own")
        return self.worker.engine

    def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> GenerationStream:
        """Admit a request now (raising if refused) and return its output stream."""
        return self.start_many([prompt_ids], [params], priority=priority, timeout_s=timeout_s)[0]

    def start_many(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        *,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[GenerationStream]:
        """Admit one call's prompts all together (raising, with none admitted, if
        refused) and return their output streams in order."""
        loop = asyncio.get_running_loop()
        queues: list[Mailbox] = []
        requests: list[tuple[str, list[int], SamplingParams, Sink]] = []
        for prompt, p in zip(prompts, params, strict=True):
            outputs = Mailbox()
            queues.append(outputs)
            requests.append((self.worker.new_request_id(), prompt, p, QueueSink(loop, outputs)))
        admitted = self.worker.submit_many(
            requests, priority=priority, timeout_s=timeout_s, max_waiting=self.max_waiting
        )
        return [
            GenerationStream(self.worker, request_id, prompt, outputs)
            for (request_id, *_), prompt, outputs in zip(requests, admitted, queues, strict=True)
        ]


class Mailbox:
    """A request's outputs on their way to its stream: the part of an ``asyncio.Queue``
    a stream uses (one reader; the event loop's thread only) without the rest of its
    bookkeeping, since a step of 64 streams puts 64 outputs and wakes 64 readers."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[RequestOutput | CarpoolError] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: RequestOutput | CarpoolError) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | CarpoolError:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> RequestOutput | CarpoolError:
        """The oldest output; ``IndexError`` when there is none."""
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class QueueSink:
    """A sink into a ``Mailbox`` of ``loop`` (any thread may call it); the engine
    worker hands a step's outputs for one loop over in one call."""

    loop: asyncio.AbstractEventLoop
    queue: Mailbox

    def __call__(self, item: RequestOutput | CarpoolError) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list[tuple[QueueSink, RequestOutput | CarpoolError]]) -> None:
    """On the loop: each output into its request's queue."""
    for sink, item in items:
        sink.queue.put_nowait(item)


class GenerationStream:
    """One request's outputs as they come. Iterate it to the end, or ``close()`` it:
    closing an unfinished stream aborts the request."""

    def __init__(
        self,
        worker: GenerationWorker,
        request_id: str,
        prompt_ids: list[int],
        outputs: Mailbox,
    ) -> None:
        self.worker = worker
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self._outputs = outputs
        self._held: RequestOutput | CarpoolError | None = None
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._next()
                if isinstance(item, CarpoolError):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                    if item.error is not None:
                        raise ModelExecutionError(item.error)
                    if _timed_out(item):
                        raise Overloaded(
                            "the request could not start before its deadline",
                            retry_after_s=RETRY_AFTER_S,
                        )
                yield item
        finally:
            self.close()

    async def _next(self) -> RequestOutput | CarpoolError:
        """The next output; outputs already waiting behind it (a consumer that fell
        behind, under load) join it, so each becomes one event, not many."""
        item = self._held if self._held is not None else await self._outputs.get()
        self._held = None
        while isinstance(item, RequestOutput) and not item.finished and not self._outputs.empty():
            following = self._outputs.get_nowait()
            if isinstance(following, CarpoolError):
                self._held = following
                break
            item = item.followed_by(following)
        return item

    async def final(self) -> RequestOutput:
        """Wait for the end; the last output (which holds everything)."""
        last: RequestOutput | None = None
        async for out in self:
            last = out
        assert last is not None
        return last

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.worker.abort(self.request_id)


def _timed_out(out: RequestOutput) -> bool:
    return any(o.finish_reason is FinishReason.TIMEOUT for o in out.outputs)
