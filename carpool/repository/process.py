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
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from carpool.batching.request import Failed
from carpool.errors import BatchFailed, CarpoolError, ModelExecutionError
from carpool.repository import user_metrics
from carpool.repository.backends import Outputs, create_backend
from carpool.repository.bls import Arrays, CallModel
from carpool.repository.errors import RepositoryError
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec
from carpool.repository.user_metrics import FamilySnapshot

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


def _answer_control(control: Connection, backend: Any) -> None:
    """The worker's control thread: each question (a number and what is asked) is
    answered with the number and the answer, while the main thread may be running a
    batch: ``ready`` (the model's ``is_ready``) or ``metrics`` (this process's custom
    metrics)."""
    while True:
        try:
            number, what = control.recv()
        except (EOFError, OSError):
            return
        if what == "ready":
            is_ready = getattr(backend, "is_ready", None)
            control.send((number, bool(is_ready()) if callable(is_ready) else True))
        else:
            control.send((number, user_metrics.REGISTRY.snapshot()))


def _worker_main(
    conn: Connection, control: Connection, spec: ModelSpec, instance: int, device: str
) -> None:
    """The worker process: load, say so, then run every batch it is sent (and answer
    readiness and metrics questions on ``control``, from a thread of its own)."""
    lock = threading.Lock()  # one exchange on the pipe at a time (BLS calls from threads)

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
    threading.Thread(target=_answer_control, args=(control, backend), daemon=True).start()
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
            answer = ("ok", backend.execute(message))
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
        self._checking = threading.Lock()  # one question on the control pipe at a time
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
        process = self._context.Process(
            target=_worker_main,
            args=(child, control_child, self.spec, self._instance, self._device),
            name=f"carpool-model-{self.spec.name}-{self._instance}",
            daemon=True,
        )
        process.start()
        child.close()
        control_child.close()
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
            self._process, self._conn, self._control = process, parent, control
            self.has_ready_hook = bool(detail)
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def execute(
        self, payloads: list[TensorPayload], timeout_s: float | None = None
    ) -> list[Outputs | Failed]:
        """Run one batch in the worker. ``timeout_s`` (None: no limit) bounds the whole
        wait, for a restart in progress and a busy pipe too; past it ``ExecutionTimedOut``
        is raised, and a worker that was running the batch is killed and a new one
        started in the background."""
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

    def _exchange_batch(
        self, payloads: list[TensorPayload], deadline: float | None
    ) -> list[Outputs | Failed]:
        with self._lock:
            conn, process = self._conn, self._process
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
        return list(result)

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
                control.send((self._check_number, what))
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
