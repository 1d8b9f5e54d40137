"""Process isolation (as Triton's Python stub): a model instance in its own process.

The worker process loads the user's model with the in-process backend and answers
batches over a pipe (payloads and results are pickled: numpy arrays and plain
objects). While it runs a batch, the model's BLS calls (``InferenceRequest.exec``)
come back over the same pipe and the server answers them (``call_model``), so a
process-isolated model calls other models as an in-process one does. If the process
dies (a crash, ``os._exit``, a signal) the batch in flight fails with
``BatchFailed`` and a new process is started in the background; ``healthy`` is
false until it has loaded. A batch past the execution timeout is the caller's to
notice: it ``restart``s the worker (or passes a timeout to ``execute``).

A decoupled model's responses, sent from its own threads during ``execute`` or after
it returned, cross on a pipe of their own (each request's stream by a number the
worker gives it) into a ``ResponseStream`` here; if the worker dies, every stream it
left open fails. A consumer that leaves a stream before its final response is told to
the worker (on the control pipe, by the stream's number), whose model's sender then
reports it (``is_cancelled``), as Triton's stub is told of a cancelled request.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from carpool.batching.request import Failed
from carpool.errors import BatchFailed, CarpoolError, ModelExecutionError
from carpool.repository import user_metrics
from carpool.repository.backends import create_backend
from carpool.repository.bls import Arrays, CallModel
from carpool.repository.decoupled import ResponseStream
from carpool.repository.errors import RepositoryError
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec
from carpool.repository.user_metrics import FamilySnapshot

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


def _answer_control(control: Connection, backend: Any, streams: _WorkerStreams) -> None:
    """The worker's control thread: each question (a number and what is asked) is
    answered with the number and the answer, while the main thread may be running a
    batch: ``ready`` (the model's ``is_ready``) or ``metrics`` (this process's custom
    metrics). ``cancel`` is a notice, not answered: the stream of that number lost its
    consumer."""
    while True:
        try:
            number, what = control.recv()
        except (EOFError, OSError):
            return
        if what == "cancel":
            streams.cancel(number)
        elif what == "ready":
            is_ready = getattr(backend, "is_ready", None)
            control.send((number, bool(is_ready()) if callable(is_ready) else True))
        else:
            control.send((number, user_metrics.REGISTRY.snapshot()))


@dataclass(frozen=True)
class StreamKey:
    """In a worker's answer, a decoupled request's stream: its responses come on the
    responses pipe under this number."""

    number: int


class _WorkerStreams:
    """In the worker, its decoupled requests' streams by number, from the batch that
    opened each until its final response is sent, all on the one responses pipe."""

    def __init__(self, responses: Connection) -> None:
        self._responses = responses
        self._numbers = itertools.count()
        self._lock = threading.Lock()  # the streams by number
        self._sending = threading.Lock()  # one sender at a time on the pipe
        self._open: dict[int, ResponseStream] = {}

    def answered(self, results: list[Any]) -> list[Any]:
        """A batch's results as the worker sends them: each ``ResponseStream`` (a
        decoupled request's) replaced by its ``StreamKey``, its responses sent with
        its number from now on."""
        answered: list[Any] = []
        for result in results:
            if isinstance(result, ResponseStream):
                key = StreamKey(next(self._numbers))
                with self._lock:
                    self._open[key.number] = result
                result.forward(functools.partial(self._send, key.number))
                answered.append(key)
            else:
                answered.append(result)
        return answered

    def cancel(self, number: int) -> None:
        """The server's consumer of stream ``number`` left (ended streams: nothing)."""
        with self._lock:
            stream = self._open.get(number)
        if stream is not None:
            stream.cancelled = True

    def _send(self, number: int, item: Any) -> None:
        """Any of the model's threads; the threads of every stream share the pipe."""
        if item is None:
            with self._lock:
                self._open.pop(number, None)
        with self._sending, contextlib.suppress(OSError):  # the server is gone: nobody reads
            self._responses.send((number, item))


def _worker_main(
    conn: Connection,
    control: Connection,
    responses: Connection,
    spec: ModelSpec,
    instance: int,
    device: str,
) -> None:
    """The worker process: load, say so, then run every batch it is sent (and answer
    readiness and metrics questions on ``control``, from a thread of its own; a
    decoupled model's responses go on ``responses``)."""
    lock = threading.Lock()  # one exchange on the pipe at a time (BLS calls from threads)
    streams = _WorkerStreams(responses)

    def call_over_pipe(
        caller: str,
        name: str,
        version: str,
        inputs: Arrays,
        outputs: tuple[str, ...],
        parameters: Mapping[str, Any],
        decoupled: bool,
    ) -> list[Arrays]:
        with lock:
            call = (caller, name, version, inputs, outputs, dict(parameters), decoupled)
            conn.send(("call", call))
            status, detail = conn.recv()
        if status == "error":
            raise detail
        answer: list[Arrays] = detail
        return answer

    try:
        backend = create_backend(spec, instance, device, call_over_pipe)
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    hook = bool(getattr(backend, "has_ready_hook", False))
    threading.Thread(target=_answer_control, args=(control, backend, streams), daemon=True).start()
    conn.send(("ready", hook))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        answer: tuple[str, Any]
        try:
            answer = ("ok", streams.answered(backend.execute(message)))
        except (Exception, SystemExit) as exc:  # sys.exit in execute fails the batch only
            answer = ("raise", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        with lock:
            conn.send(answer)
    try:
        backend.finalize()
    finally:
        conn.close()


class ExecutionTimedOut(BatchFailed):
    """A batch outlived its timeout; its worker was killed and is being restarted."""


class _OpenStreams:
    """One worker's decoupled requests' streams, by number, until both sides are done
    with each: the responses pipe's reader fills a stream to its final flag, the batch
    that named it claims it; whichever comes first makes it. Once the worker is gone
    (``fail_all``) each stream not ended fails, and so does any claimed later."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, ResponseStream] = {}
        self._claimed: set[int] = set()
        self._ended: set[int] = set()
        self._gone = ""

    def claim(self, number: int) -> ResponseStream:
        """The stream a batch's answer names."""
        with self._lock:
            stream = self._stream(number, self._claimed)
            gone = self._gone if number not in self._ended else ""
        if gone:
            stream.put(Failed(BatchFailed(gone)))
        return stream

    def deliver(self, number: int, item: Any) -> None:
        """A response (None: the final flag) the worker sent."""
        with self._lock:
            stream = self._stream(number, self._ended if item is None else None)
        if item is None:
            stream.finish()
        else:
            stream.put(item)

    def _stream(self, number: int, done_with: set[int] | None) -> ResponseStream:
        stream = self._streams.setdefault(number, ResponseStream())
        if done_with is not None:
            done_with.add(number)
        if number in self._claimed and number in self._ended:
            del self._streams[number]
            self._claimed.discard(number)
            self._ended.discard(number)
        return stream

    def fail_all(self, why: str) -> None:
        with self._lock:
            self._gone = why
            failing = [n for n in self._streams if n not in self._ended]
            streams = [self._stream(n, self._ended) for n in failing]
        for stream in streams:
            stream.put(Failed(BatchFailed(why)))


class ProcessBackend:
    """One model instance in a worker process; a ``Backend`` whose ``execute`` takes a
    timeout (the calling thread waits on the worker itself)."""

    def __init__(
        self, spec: ModelSpec, instance: int, device: str, call_model: CallModel | None = None
    ) -> None:
        self.spec = spec
        self.call_model = call_model
        # Called (on a restart thread) when a restarted worker has loaded.
        self.on_ready: Callable[[], None] | None = None
        self._instance = instance
        self._device = device
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        # One exchange on the pipe at a time: a batch and a BLS call may meet here.
        self._exchange = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = threading.Event()
        self._start_error = ""
        self.restarts = 0
        self.has_ready_hook = False
        self._control: Connection | None = None
        self._streams = _OpenStreams()  # the current worker's
        self._checking = threading.Lock()  # one question on the control pipe at a time
        self._control_sending = threading.Lock()  # a question and a notice may meet
        self._check_number = 0
        self._start()
        self._ready.wait()
        if self._start_error:
            raise RepositoryError(self._start_error)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def healthy(self) -> bool:
        """Whether a loaded worker stands (not while one is being restarted, nor after
        a restart failed to load)."""
        return self._ready.is_set() and self._conn is not None

    @property
    def start_error(self) -> str:
        """Why the last (re)start failed to load; "" if it did not."""
        return self._start_error

    def restart(self) -> None:
        """Kill the worker and start a new one (unless a restart is already under
        way); return once the new one has loaded or failed to. Blocks: never on the
        runtime thread."""
        self._kill()
        self._restart_in_background()
        self._ready.wait()

    def _start(self) -> None:
        """Start a worker and wait for it to load (on the calling thread)."""
        self._ready.clear()
        parent, child = self._context.Pipe()
        control, control_child = self._context.Pipe()
        responses, responses_child = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_worker_main,
            args=(child, control_child, responses_child, self.spec, self._instance, self._device),
            name=f"carpool-model-{self.spec.name}-{self._instance}",
            daemon=True,
        )
        process.start()
        child.close()
        control_child.close()
        responses_child.close()
        self._start_error = ""
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise EOFError
            status, detail = parent.recv()
        except EOFError:
            status, detail = "error", f"worker process exited with code {process.exitcode}"
        if status != "ready":
            process.join(5)
            self._start_error = f"model '{self.spec.name}': {detail}"
        else:
            streams = _OpenStreams()
            with self._lock:
                self._process, self._conn, self._control = process, parent, control
                self._streams = streams
            self.has_ready_hook = bool(detail)
            threading.Thread(
                target=self._read_responses,
                args=(responses, streams, parent),
                name=f"carpool-model-{self.spec.name}-responses",
                daemon=True,
            ).start()
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def execute(self, payloads: list[TensorPayload], timeout_s: float | None = None) -> list[Any]:
        """Run one batch in the worker: one result per payload, its outputs, ``Failed``
        or (a decoupled model's) its ``ResponseStream``. ``timeout_s`` (None: no
        limit) bounds the whole wait, for a restart in progress and a busy pipe too;
        past it ``ExecutionTimedOut`` is raised, and a worker that was running the
        batch is killed and a new one started in the background."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._take_turn(deadline):
            raise self._timed_out()
        try:
            return self._exchange_batch(payloads, deadline)
        finally:
            self._exchange.release()

    def _take_turn(self, deadline: float | None) -> bool:
        """Wait for a started worker and a free pipe (``_exchange`` then held); False
        when ``deadline`` passed first."""
        if deadline is None:
            self._ready.wait()
            return self._exchange.acquire()
        return self._ready.wait(_left(deadline)) and self._exchange.acquire(timeout=_left(deadline))

    def _exchange_batch(self, payloads: list[TensorPayload], deadline: float | None) -> list[Any]:
        with self._lock:
            conn, process, streams = self._conn, self._process, self._streams
            control = self._control
        if conn is None:
            raise BatchFailed(
                f"model '{self.spec.name}' has no worker process: {self._start_error}"
            )
        try:
            conn.send(payloads)
            while True:
                if deadline is not None and not conn.poll(_left(deadline)):
                    self._kill()
                    self._restart_in_background(conn)
                    raise self._timed_out()
                status, result = conn.recv()
                if status != "call":
                    break
                conn.send(self._serve_call(result))
        except (EOFError, OSError, BrokenPipeError):
            code = process.exitcode if process is not None else None
            self._restart_in_background(conn)
            raise BatchFailed(
                f"model '{self.spec.name}': its worker process died (exit code {code}); "
                "it is being restarted"
            ) from None
        if status == "raise":
            raise ModelExecutionError(f"model '{self.spec.name}' failed: {result}")
        return [self._claim(streams, r, control) if isinstance(r, StreamKey) else r for r in result]

    def _claim(
        self, streams: _OpenStreams, key: StreamKey, control: Connection | None
    ) -> ResponseStream:
        """The stream a batch's answer names; its consumer leaving early is told to
        the worker that answered (a replaced worker's pipe is gone: nothing is told)."""
        stream = streams.claim(key.number)
        if control is not None:
            stream.on_cancel = functools.partial(self._tell, control, (key.number, "cancel"))
        return stream

    def _tell(self, control: Connection, message: tuple[int, str]) -> None:
        """Send ``message`` (a question, or a notice not answered) on a worker's control
        pipe: any thread, one at a time; a worker gone: nothing is sent."""
        with self._control_sending, contextlib.suppress(OSError):
            control.send(message)

    def _read_responses(
        self, responses: Connection, streams: _OpenStreams, conn: Connection
    ) -> None:
        """One worker's decoupled responses into their streams until it is gone; then
        its open streams fail, and a worker that died is replaced."""
        while True:
            try:
                number, item = responses.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle: its stream times out
                log.exception("model %s: a response could not be read", self.spec.name)
                continue
            streams.deliver(number, item)
        responses.close()
        # The restart first: once a stream's failure is seen, a new request waits for
        # the new worker instead of meeting the dead one's pipe.
        self._restart_in_background(conn)
        streams.fail_all(
            f"model '{self.spec.name}': its worker process ended before the request's "
            "final response; it is being restarted"
        )

    def _serve_call(self, args: tuple[Any, ...]) -> tuple[str, Any]:
        """Answer a BLS call the worker's model made: ("ok", outputs) or ("error",
        the call's ``CarpoolError``)."""
        if self.call_model is None:
            return "error", ModelExecutionError("BLS calls are not served here")
        try:
            return "ok", self.call_model(*args)
        except CarpoolError as exc:
            return "error", exc
        except Exception as exc:
            log.error("model %s: a BLS call failed", self.spec.name, exc_info=exc)
            return "error", ModelExecutionError(f"{type(exc).__name__}: {exc}")

    def is_ready(self, timeout_s: float) -> bool:
        """The model's ``is_ready`` answer from the worker within ``timeout_s`` (False
        past it, or with no worker)."""
        return bool(self._ask("ready", timeout_s, False))

    def metrics(self, timeout_s: float) -> list[FamilySnapshot]:
        """The worker's custom metrics (none past ``timeout_s``, or with no worker)."""
        answer: list[FamilySnapshot] = self._ask("metrics", timeout_s, [])
        return answer

    def _ask(self, what: str, timeout_s: float, otherwise: Any) -> Any:
        """The worker's answer to ``what`` on its control pipe within ``timeout_s``,
        else ``otherwise``. Questions take turns; a late answer is skipped by the next
        question (each carries a number)."""
        if not self._checking.acquire(timeout=timeout_s):
            return otherwise
        try:
            control = self._control
            if control is None or not self.healthy:
                return otherwise
            self._check_number += 1
            deadline = time.monotonic() + timeout_s
            try:
                self._tell(control, (self._check_number, what))
                while control.poll(_left(deadline)):
                    number, answer = control.recv()
                    if number == self._check_number:
                        return answer
            except (EOFError, OSError):
                return otherwise
            return otherwise
        finally:
            self._checking.release()

    def _timed_out(self) -> ExecutionTimedOut:
        return ExecutionTimedOut(
            f"model '{self.spec.name}' did not finish a batch within its execution timeout; "
            "its worker process is being restarted"
        )

    def _kill(self) -> None:
        with self._lock:
            process = self._process
        if process is not None and process.is_alive():
            process.kill()

    def _restart_in_background(self, dead: Connection | None = None) -> None:
        """Start a new worker unless a restart is under way, or (``dead``: the pipe
        of the worker seen to die) that worker has already been replaced."""
        with self._lock:
            if not self._ready.is_set() or (dead is not None and dead is not self._conn):
                return
            self._ready.clear()
            old, self._process, self._conn = self._process, None, None
        if old is not None:
            old.join(5)
        self.restarts += 1
        log.warning("model %s: restarting its worker process", self.spec.name)
        threading.Thread(target=self._start, name="carpool-model-restart", daemon=True).start()

    def finalize(self) -> None:
        self._ready.wait(START_TIMEOUT_S)
        with self._lock:
            process, conn = self._process, self._conn
            self._process, self._conn = None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(None)
        if process is not None:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)

    def __getstate__(self) -> Any:
        raise TypeError("a ProcessBackend stays in the process that made it")


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (none left: 0)."""
    return max(0.0, deadline - time.monotonic())
