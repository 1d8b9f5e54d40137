"""A generation engine in a process of its own, as vLLM v1's engine core: the
server's process keeps the HTTP event loop, the engine's process its scheduler, model
and detokenizer, each with a GIL of its own. Under many streams one GIL held by both
is what limits a fast device (the event loop's per-token work and the engine's step
take turns); apart, they run side by side.

``EngineClient`` is the server's side: the worker ``AsyncEngine`` drives, like
``EngineWorker`` but with the engine behind a pipe. Requests are checked and admitted
here (the engine's own checks, the same waiting room), then sent; each engine step's
outputs come back as one message, which a reader thread hands to the requests' sinks
with one wake-up per event loop.

``serve_engine`` is the engine's side, three threads as vLLM v1's engine core: a
receiver reads requests and aborts off the pipe into a queue; the step loop takes
them from it, steps the engine while it has work and hands each step's outputs to a
sender, which pickles and writes them while the next step runs, with a snapshot of
the engine's statistics whenever a request finished (and at most every
``STATS_EVERY_S`` otherwise), so /metrics lags by no finished request. The step loop
itself makes no system call while it has work, but to wait on its device.

When the engine process dies, ``on_death`` is called (the server is no longer ready
and exits non-zero, as when its device runtime dies), then every request it held
fails; when the server's
process dies, the engine's finds its pipe closed and exits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from carpool.clock import Clock, MonotonicClock
from carpool.engine.async_engine import (
    EngineFront,
    EngineWorker,
    Sink,
    as_carpool_error,
    deliver_all,
)
from carpool.engine.engine import Engine, check_request
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import TokenLogprobs
from carpool.engine.sampling_params import Grammar, SamplingParams
from carpool.engine.sequence import FinishReason
from carpool.engine.structured import Grammars
from carpool.errors import (
    CarpoolError,
    ModelNotFound,
    RuntimeDead,
)
from carpool.runtime import IDLE, Venue, WorkState
from carpool.stats import EngineStats, EngineStatsData

if TYPE_CHECKING:
    from carpool.paths import PathTaken

log = logging.getLogger(__name__)

STATS_EVERY_S = 0.25
STOP_TIMEOUT_S = 30.0
# Steps' outputs the engine may run ahead of its sender by: past them a step waits, so
# a server that stops reading still holds the engine back, as a full pipe did.
SENDS_AHEAD = 8


class Described(Protocol):
    """What an engine's build says of its model, for the server: sent whole, so it
    must pickle (a tokenizer, a config; never the weights)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


Build = Callable[[], tuple[Described, Engine]]


@dataclass(frozen=True)
class EngineFacts:
    """What the server learns of a started engine."""

    model: Any  # the build's ``Described``
    max_model_len: int
    vocab_size: int
    block_size: int
    paths: tuple[PathTaken, ...]


@dataclass(frozen=True)
class _Submit:
    """Requests admitted together (one call's prompts): all start, or all fail."""

    requests: list[tuple[str, list[int], SamplingParams]]
    priority: int
    timeout_s: float | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    error: CarpoolError  # what the requests still held end with


# A completion's step on the wire: index, new text, new token ids, new log-probs,
# finish reason (its value), stop reason.
_WireCompletion = tuple[int, str, list[int], list[TokenLogprobs], str | None, str | int | None]
# A request's step: id, finished, error, cached prompt tokens, prompt log-probs, and its
# completions'. Plain tuples of what the step added: pickling the cumulative dataclass
# snapshots cost ~5 us an output on each side, a third of the server's GIL at 64 streams.
_Wire = tuple[
    str, bool, str | None, int, list[TokenLogprobs | None] | None, tuple[_WireCompletion, ...]
]


@dataclass(frozen=True)
class _Outputs:
    """One engine step's news: outputs, then errors ending requests, then (when a
    request ended, or now and then) the engine's statistics."""

    outputs: list[_Wire]
    errors: list[tuple[str, CarpoolError]]
    stats: EngineStatsData | None


def _to_wire(out: RequestOutput) -> _Wire:
    return (
        out.request_id,
        out.finished,
        out.error,
        out.num_cached_tokens,
        out.prompt_logprobs,
        tuple(
            (
                o.index,
                o.new_text,
                o.new_token_ids,
                o.new_logprobs,
                None if o.finish_reason is None else o.finish_reason.value,
                o.stop_reason,
            )
            for o in out.outputs
        ),
    )


class _Held:
    """A request the engine holds, on the server's side: its sink, its prompt, and
    its completions so far, from which each step's ``RequestOutput`` is rebuilt."""

    __slots__ = ("completions", "prompt_ids", "sink", "started")

    def __init__(self, sink: Sink, prompt_ids: list[int]) -> None:
        self.sink = sink
        self.prompt_ids = prompt_ids
        self.completions: dict[int, CompletionOutput] = {}
        self.started = False

    def output(self, wire: _Wire) -> RequestOutput:
        """The step's output as the engine made it: everything so far, and the new."""
        request_id, finished, error, cached, prompt_logprobs, completions = wire
        snapshots = []
        for index, new_text, new_ids, new_logprobs, reason, stop in completions:
            so_far = self.completions.get(index)
            if so_far is None:
                so_far = self.completions[index] = CompletionOutput(index)
            so_far.text += new_text
            so_far.token_ids += new_ids
            so_far.logprobs += new_logprobs
            snapshots.append(
                CompletionOutput(
                    index,
                    so_far.text,
                    list(so_far.token_ids),
                    list(so_far.logprobs),
                    new_text,
                    new_ids,
                    new_logprobs,
                    None if reason is None else FinishReason(reason),
                    stop,
                )
            )
        return RequestOutput(
            request_id, self.prompt_ids, snapshots, finished, error, cached, prompt_logprobs
        )


class EngineClient(EngineFront):
    """A generation engine running in a spawned process, as a runtime worker of this
    one. Construction starts the process and waits until its model is loaded
    (raising ``RuntimeError`` with the reason if it cannot load). The runtime never
    runs it (``poll`` reports it busy while requests are held, so retiring it waits
    for them); ``close`` and ``fail_all`` stop the process."""

    venue = Venue.ENGINE_PROCESS

    def __init__(
        self,
        build: Build,
        name: str,
        *,
        rank: int = 0,
        log_level: str = "INFO",
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        super().__init__(name, rank)
        self._on_death = on_death
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_main,
            args=(child, build, name, log_level),
            name=f"carpool-engine-{name}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.facts = self._wait_ready()
        self.stats = EngineStats()
        self._grammars = Grammars(
            self.facts.model.tokenizer,
            self.facts.vocab_size,
            sorted(self.facts.model.eos_token_ids),
        )
        self._notify: Callable[[], None] = lambda: None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the two below (event loop and reader)
        self._held: dict[str, _Held] = {}
        self._stopping = False
        self._reader = threading.Thread(
            target=self._read, name=f"carpool-engine-reader-{name}", daemon=True
        )
        self._reader.start()

    def _wait_ready(self) -> EngineFacts:
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self.process.join()
            raise RuntimeError(
                f"the engine process of {self.name} exited while loading "
                f"(exit code {self.process.exitcode})"
            ) from None
        if isinstance(reply, str):
            self.process.join()
            raise RuntimeError(reply)
        facts: EngineFacts = reply
        return facts

    # -- any thread -------------------------------------------------------------------

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        return self.facts.paths

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def block_size(self) -> int:
        return self.facts.block_size

    def compile_grammar(self, grammar: Grammar, param: str) -> None:
        # Checked here so a bad grammar is the request's 400; the engine compiles its own.
        self._grammars.compile(grammar, param)

    def submit_many(
        self,
        requests: list[tuple[str, list[int], SamplingParams, Sink]],
        *,
        priority: int = 0,
        timeout_s: float | None = None,
        max_waiting: int | None = None,
    ) -> list[list[int]]:
        """As ``EngineWorker.submit_many``; ``RuntimeDead`` once the process is gone."""
        facts = self.facts
        prompts = [
            check_request(p, params, facts.max_model_len, facts.vocab_size)
            for _, p, params, _ in requests
        ]
        ids = [request_id for request_id, *_ in requests]
        with self._admitting(len(requests), max_waiting):
            with self._lock:
                for (request_id, _, _, sink), prompt in zip(requests, prompts, strict=True):
                    self._held[request_id] = _Held(sink, prompt)
            sent = [(i, prompt, r[2]) for i, prompt, r in zip(ids, prompts, requests, strict=True)]
            if not self._send(_Submit(sent, priority, timeout_s)):
                self._forget(ids)
                raise RuntimeDead(f"the engine process of {self.name} is not running")
        return prompts

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def close(self, reason: str) -> None:
        """Take no more requests (``ModelNotFound`` saying ``reason``), stop the
        process and fail whatever it still held with that."""
        self._entry.close(lambda: ModelNotFound(reason, param="model"))
        self.fail_all(ModelNotFound(reason, param="model"))

    def fail_all(self, error: Exception) -> None:
        """Stop the process; every request still held ends with ``error``."""
        self._entry.close()
        carpool_error = as_carpool_error(error)
        with self._lock:
            self._stopping = True
        if self._send(_Stop(carpool_error)):
            self._reader.join(STOP_TIMEOUT_S)
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            log.error("the engine process of %s did not stop; killing it", self.name)
            self.process.kill()
            self.process.join()
        self._fail_held(carpool_error)

    # -- the runtime thread: nothing runs here, but retiring waits for the requests -----

    def attach(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def poll(self, now: float) -> WorkState:
        return WorkState(busy=True) if self._held else IDLE

    def run_once(self, now: float) -> None:
        raise RuntimeError("a worker whose venue is its engine process is never run here")

    def recover(self, error: Exception) -> None:
        self._fail_held(as_carpool_error(error))

    # -- the reader thread -----------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message is None:  # the engine stopped as asked
                    return
                assert isinstance(message, _Outputs)
                if message.stats is not None:
                    self.stats.load(message.stats)
                self._dispatch(message)
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here: fail what is held rather than leave it hanging
            log.exception("reading the outputs of %s's engine failed", self.name)
        with self._lock:
            stopping = self._stopping
        if not stopping:
            self._died()

    def _dispatch(self, news: _Outputs) -> None:
        deliveries: list[tuple[Sink | None, RequestOutput | CarpoolError]] = []
        started = 0
        with self._lock:
            for wire in news.outputs:
                request_id, finished, *_ = wire
                held = self._held.pop(request_id, None) if finished else self._held.get(request_id)
                if held is None:
                    continue
                if not held.started:
                    held.started = True
                    started += 1
                deliveries.append((held.sink, held.output(wire)))
            for request_id, error in news.errors:
                held = self._held.pop(request_id, None)
                if held is not None:
                    started += not held.started
                    deliveries.append((held.sink, error))
            idle = not self._held
        self._room.leave(started)
        deliver_all(deliveries)
        if idle:
            self._notify()  # a runtime retiring this worker looks again

    def _died(self) -> None:
        self.process.join(5.0)
        message = f"the engine process of {self.name} died (exit code {self.process.exitcode})"
        log.critical("%s; failing its requests", message)
        # The server is told first, as the runtime thread's death is: a client that
        # has its request's failure must find the server no longer ready.
        if self._on_death is not None:
            self._on_death(RuntimeError(message))
        self._entry.close(lambda: RuntimeDead(message))
        self._fail_held(RuntimeDead(message))

    # -- helpers ---------------------------------------------------------------------------

    def _send(self, message: _Submit | _Abort | _Stop) -> bool:
        """Send to the engine; False if its process is gone."""
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # a broken pipe, or closed
            return False
        return True

    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._held.pop(request_id, None)
        self._room.leave(len(request_ids))

    def _fail_held(self, error: CarpoolError) -> None:
        with self._lock:
            held, self._held = self._held, {}
        self._room.leave(sum(not h.started for h in held.values()))
        deliver_all((h.sink, error) for h in held.values())


# -- the engine's process ------------------------------------------------------------------


def _engine_main(conn: Connection, build: Build, name: str, log_level: str) -> None:
    """The spawned process: build the engine, say what it is, serve it."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A terminal's Ctrl-C reaches the whole process group: the server drains its
    # streams, so the engine goes on until told to stop (or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, engine = build()
    except Exception as exc:
        log.exception("loading %s failed", name)
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(
        EngineFacts(
            model,
            engine.max_model_len,
            engine.spec.vocab_size,
            engine.blocks.block_size,
            engine.paths,
        )
    )
    serve_engine(conn, EngineWorker(engine, name))


class _Quit:
    """Handed to the sender last when the engine is not stopping cleanly: what came
    before is sent, no stop marker after it (the server sees the process end)."""


class _Sender:
    """Sends the engine's news on the pipe from a thread of its own, in the order it is
    handed over; on ``close``, the stop marker (None) after it all when the engine was
    told to stop. A failed send means the server's process is gone (``gone``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue[_Outputs | _Quit | None] = queue.Queue(SENDS_AHEAD)
        self.gone = threading.Event()
        self._thread = threading.Thread(target=self._main, name="carpool-engine-sender")
        self._thread.start()

    def send(self, news: _Outputs) -> None:
        self._queue.put(news)

    def close(self, stopped: bool) -> None:
        """Send what is handed over (then the stop marker if ``stopped``); return once
        sent, or once the server is found gone."""
        self._queue.put(None if stopped else _Quit())
        self._thread.join()

    def _main(self) -> None:
        while not isinstance(news := self._queue.get(), _Quit):
            try:
                self._conn.send(news)
            except OSError:
                self.gone.set()
                # Nobody reads: drain, so a step waiting to hand over goes on to see it.
                while news is not None and not isinstance(news, _Quit):
                    news = self._queue.get()
                return
            if news is None:
                return


class _PipeClosed:
    """Put in the inbox last when the server's end of the pipe is gone."""


_Inbox = queue.SimpleQueue[_Submit | _Abort | _Stop | _PipeClosed]


class _Receiver:
    """Reads the server's messages off the pipe on a thread of its own (as vLLM v1's
    engine core's input thread), so the step loop takes them from a queue without a
    system call a step: on a busy host each call into the kernel was a point where
    the loop lost its core (an engine process at 64 streams on two shared cores)."""

    def __init__(self, conn: Connection) -> None:
        self.inbox: _Inbox = queue.SimpleQueue()
        self._conn = conn
        self._thread = threading.Thread(
            target=self._main, name="carpool-engine-receiver", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        try:
            while True:
                self.inbox.put(self._conn.recv())
        except (EOFError, OSError):
            self.inbox.put(_PipeClosed())


def serve_engine(conn: Connection, worker: EngineWorker, clock: Clock | None = None) -> None:
    """Serve ``worker``'s engine over ``conn`` until told to stop or the pipe closes:
    take what came, run a step if there is work, hand its outputs to the sender."""
    receiver = _Receiver(conn)
    sender = _Sender(conn)
    stopped = False
    try:
        stopped = _serve(receiver.inbox, worker, sender, clock or MonotonicClock())
    finally:
        sender.close(stopped)


def _serve(inbox: _Inbox, worker: EngineWorker, sender: _Sender, clock: Clock) -> bool:
    """True once told to stop; False when the server's process is gone."""
    outputs: list[_Wire] = []
    errors: list[tuple[str, CarpoolError]] = []
    ended = False
    stats_at = float("-inf")

    def collect(request_id: str, item: RequestOutput | CarpoolError) -> None:
        nonlocal ended
        if isinstance(item, RequestOutput):
            outputs.append(_to_wire(item))
            ended = ended or item.finished
        else:
            errors.append((request_id, item))
            ended = True

    while not sender.gone.is_set():
        stop = _take(inbox, worker, collect, wait=not worker.engine.has_work)
        if isinstance(stop, _PipeClosed):
            return False
        now = clock.now()
        if stop is None:
            try:
                if worker.poll(now).ready_since is not None:
                    worker.run_once(now)
            except Exception as exc:  # a bug in the engine: its requests fail, it goes on
                log.exception("engine step failed")
                worker.recover(exc)
        else:
            worker.fail_all(stop.error)
        stats = None
        if ended or now - stats_at >= STATS_EVERY_S or stop is not None:
            stats, stats_at = worker.stats.snapshot(), now
        if outputs or errors or stats is not None:
            sender.send(_Outputs(outputs, errors, stats))
            outputs, errors, ended = [], [], False
        if stop is not None:
            return True
    return False


def _take(
    inbox: _Inbox,
    worker: EngineWorker,
    collect: Callable[[str, RequestOutput | CarpoolError], None],
    wait: bool,
) -> _Stop | _PipeClosed | None:
    """Apply every message waiting in ``inbox`` (waiting for one if ``wait``); the stop
    message, or the pipe's end, if one came."""
    try:
        message = inbox.get() if wait else inbox.get_nowait()
    except queue.Empty:
        return None
    while True:
        if isinstance(message, _Stop | _PipeClosed):
            return message
        if isinstance(message, _Abort):
            worker.abort(message.request_id)
        else:
            _submit(worker, message, collect)
        try:
            message = inbox.get_nowait()
        except queue.Empty:
            return None


def _submit(
    worker: EngineWorker,
    message: _Submit,
    collect: Callable[[str, RequestOutput | CarpoolError], None],
) -> None:
    # The pipe carries each step's new pieces alone (``_to_wire``): the engine builds
    # no copy of what came before (``output_kind`` delta; the server's side keeps it).
    requests: list[tuple[str, list[int], SamplingParams, Sink]] = [
        (request_id, prompt, _as_delta(params), functools.partial(collect, request_id))
        for request_id, prompt, params in message.requests
    ]
    try:
        worker.submit_many(requests, priority=message.priority, timeout_s=message.timeout_s)
    except CarpoolError as exc:  # checked by the server already; the engine has the last word
        for request_id, *_ in message.requests:
            collect(request_id, exc)


def _as_delta(params: SamplingParams) -> SamplingParams:
    if params.output_kind != "cumulative":
        return params
    return dataclasses.replace(params, output_kind="delta")
