"""A repository model as the dynamic batcher's ``BatchModel`` and ``InstancePool``:
the user's code runs on the model's own instances, never on the runtime thread.

Each instance (``instance_group`` count) has its own thread: an in-process instance
runs the user's code on it; a process-isolated one uses it to send the batch to its
worker process and wait for the answer. The batcher takes a free instance, hands it
the batch and moves on; a batch past the execution timeout is failed by the batcher,
which then abandons the instance here: a worker process is killed and restarted, an
in-process instance's thread is left behind (a thread cannot be stopped) and a new
instance is loaded on a new thread. Until a replacement stands its slot takes no
batch; the model is unready while no instance is healthy.

What comes back is checked against the config: one result per request, every
requested output there, with its declared datatype and shape and the request's
batch size. A wrong output fails that request with a message that says what was
wrong.
"""

from __future__ import annotations

import concurrent.futures
import enum
import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from carpool.batching.instances import Forward
from carpool.batching.request import Failed
from carpool.errors import BatchFailed, CarpoolError, ModelExecutionError, ModelUnavailable
from carpool.repository.backends import Backend, Outputs
from carpool.repository.datatypes import datatype_of, numpy_dtype, with_bytes
from carpool.repository.decoupled import ResponseStream
from carpool.repository.payload import ModelAnswer, TensorPayload, parameters_of
from carpool.repository.process import ExecutionTimedOut, ProcessBackend
from carpool.repository.spec import ModelSpec, TensorSpec
from carpool.repository.user_metrics import FamilySnapshot

log = logging.getLogger(__name__)

T = TypeVar("T")
Batch = tuple[list[TensorPayload], list[Outputs | Failed]]
FINALIZE_TIMEOUT_S = 30.0
READY_CHECK_TIMEOUT_S = 5.0  # Triton's bound on a model's is_ready


class SlotState(enum.Enum):
    FREE = "free"
    BUSY = "busy"  # running a batch the batcher handed it
    REPLACING = "replacing"  # abandoned; a new instance is starting
    LOST = "lost"  # its replacement failed to load


@dataclass(eq=False)
class _Slot:
    """One instance: its backend, the thread it runs on and what it is doing."""

    backend: Backend
    thread: InstanceThread
    state: SlotState = SlotState.FREE
    note: str = ""  # why it is LOST

    @property
    def healthy(self) -> bool:
        """Whether its backend can run a batch now (a worker process being restarted
        cannot)."""
        return not isinstance(self.backend, ProcessBackend) or self.backend.healthy

    @property
    def usable(self) -> bool:
        return self.state in (SlotState.FREE, SlotState.BUSY) and self.healthy

    @property
    def lost(self) -> str:
        """Why no instance will come back to this slot ("": one will)."""
        if isinstance(self.backend, ProcessBackend) and self.backend.start_error:
            return f"restarting its worker failed: {self.backend.start_error}"
        return self.note if self.state is SlotState.LOST else ""


class UserBatchModel:
    """Runs batches of ``TensorPayload`` on the user's model instances.

    ``replace(index)`` loads a new in-process instance for slot ``index`` when one
    is abandoned (None: the same backend object runs on a new thread, for stateless
    backends). Slot states are guarded by a lock: the runtime thread takes and gives
    back slots, replacement threads free them."""

    def __init__(
        self,
        spec: ModelSpec,
        instances: Sequence[Backend],
        timeout_s: float,
        replace: Callable[[int], Backend] | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a model needs at least one instance")
        self.spec = spec
        self.ragged = spec.ragged
        self.timeout_s = timeout_s
        self._replace = replace
        self._notify: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._slots = [
            _Slot(backend, InstanceThread(f"carpool-{spec.name}-{i}"))
            for i, backend in enumerate(instances)
        ]
        self._next = 0
        for slot in self._slots:
            if isinstance(slot.backend, ProcessBackend):
                # A worker restarted after a crash: the runtime looks again.
                slot.backend.on_ready = lambda: self._notify()

    @property
    def instance_count(self) -> int:
        return len(self._slots)

    @property
    def ready(self) -> bool:
        return not self.unready_reason

    @property
    def unready_reason(self) -> str:
        """Why the model is not ready ("": it is): no instance is healthy now. Its
        requests still wait in its queue while one is being restarted."""
        with self._lock:
            if any(s.usable for s in self._slots):
                return ""
            lost = self._lost_reason_locked()
        why = f": {lost}" if lost else "; one is being restarted"
        return f"model '{self.spec.name}' is unready: no instance of it is healthy{why}"

    @property
    def lost_reason(self) -> str:
        """Why no instance of the model will come back ("": one is or will be): its
        requests are refused until it is loaded again."""
        with self._lock:
            return self._lost_reason_locked()

    def _lost_reason_locked(self) -> str:
        reasons = [s.lost for s in self._slots]
        if not all(reasons):
            return ""
        return f"model '{self.spec.name}' has no instance left: {reasons[0]}"

    def check_ready(self, timeout_s: float = READY_CHECK_TIMEOUT_S) -> bool:
        """Readiness as ``/v2/models/NAME/ready`` reports it: some instance healthy,
        and, where the model defines Triton's ``is_ready`` hook, every healthy
        instance's hook answering ``True`` within ``timeout_s`` (asked at once, each
        on a thread of its own; a worker process answers on a pipe of its own, while
        it may be running a batch). Blocks up to ``timeout_s``: not on the event loop."""
        with self._lock:
            usable = [s.backend for s in self._slots if s.usable]
        if not usable:
            return False
        hooked = [b for b in usable if getattr(b, "has_ready_hook", False)]
        if not hooked:
            return True
        answers = [_answer(functools.partial(_ask_ready, b, timeout_s)) for b in hooked]
        done, late = concurrent.futures.wait(answers, timeout_s)
        return not late and all(f.exception() is None and f.result() for f in done)

    def worker_metrics(self, timeout_s: float) -> list[list[FamilySnapshot]]:
        """The custom metrics of each healthy worker process (in-process instances
        record into this process's registry, read apart). Blocks up to ``timeout_s``."""
        with self._lock:
            workers = [
                s.backend for s in self._slots if s.usable and isinstance(s.backend, ProcessBackend)
            ]
        return [w.metrics(timeout_s) for w in workers]

    # --- InstancePool (runtime thread) ----------------------------------------------

    def attach(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def has_free(self) -> bool:
        with self._lock:
            return any(s.state is SlotState.FREE and s.healthy for s in self._slots)

    def take(self) -> int | None:
        """The next free healthy instance in turn, now busy."""
        with self._lock:
            count = len(self._slots)
            for step in range(count):
                index = (self._next + step) % count
                slot = self._slots[index]
                if slot.state is SlotState.FREE and slot.healthy:
                    slot.state = SlotState.BUSY
                    self._next = (index + 1) % count
                    return index
        return None

    def run(self, index: int, job: Callable[[Forward], None]) -> None:
        slot = self._slots[index]
        slot.thread.submit(job, lambda payloads: (payloads, _execute(slot.backend, payloads)))

    def give_back(self, index: int) -> None:
        with self._lock:
            slot = self._slots[index]
            if slot.state is SlotState.BUSY:
                slot.state = SlotState.FREE

    def abandon_note(self, index: int) -> str:
        if isinstance(self._slots[index].backend, ProcessBackend):
            return "its worker process is being restarted"
        return "its instance is being replaced"

    def abandon(self, index: int) -> None:
        with self._lock:
            slot = self._slots[index]
            slot.state = SlotState.REPLACING
        target: Callable[[int, _Slot], None] = (
            self._restart_worker
            if isinstance(slot.backend, ProcessBackend)
            else self._replace_instance
        )
        threading.Thread(
            target=target,
            args=(index, slot),
            name=f"carpool-{self.spec.name}-{index}-replace",
            daemon=True,
        ).start()

    def _restart_worker(self, index: int, slot: _Slot) -> None:
        """Kill ``slot``'s worker process and start a new one (its thread, waiting on
        the pipe, sees the old one die and lets the batch go); the slot is free again
        once the new one has loaded."""
        assert isinstance(slot.backend, ProcessBackend)
        slot.backend.restart()
        with self._lock:
            if slot.state is SlotState.REPLACING:
                slot.state = SlotState.FREE  # still lost if the restart failed (``lost``)
        self._notify()

    def _replace_instance(self, index: int, old: _Slot) -> None:
        """Load a new in-process instance for ``index`` on a new thread (the old
        thread stays hung in the user's code: a daemon, holding nothing of ours)."""
        try:
            backend = old.backend if self._replace is None else self._replace(index)
        except Exception as exc:
            log.error("model %s: replacing instance %d failed: %s", self.spec.name, index, exc)
            with self._lock:
                old.state = SlotState.LOST
                old.note = f"loading a replacement for a hung instance failed: {exc}"
            self._notify()
            return
        fresh = _Slot(backend, InstanceThread(f"carpool-{self.spec.name}-{index}"))
        with self._lock:
            self._slots[index] = fresh
        log.warning("model %s: instance %d replaced after it hung", self.spec.name, index)
        self._notify()

    # --- BatchModel -------------------------------------------------------------------

    def collate(self, payloads: list[TensorPayload]) -> list[TensorPayload]:
        return payloads

    def forward(self, payloads: list[TensorPayload]) -> Batch:
        """Run a batch now on a usable instance and wait for it, at most the execution
        timeout (a BLS call's path; the batcher hands batches over with ``run``)."""
        slot = self._any_usable()
        timeout = self.timeout_s or None
        if isinstance(slot.backend, ProcessBackend):
            try:
                return payloads, slot.backend.execute(payloads, timeout)
            except ExecutionTimedOut as exc:
                raise BatchFailed(exc.message) from None
        future = slot.thread.submit(_execute, slot.backend, payloads)
        try:
            return payloads, future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise BatchFailed(
                f"model '{self.spec.name}' did not finish a call within its execution "
                f"timeout of {self.timeout_s:g}s"
            ) from None

    def _any_usable(self) -> _Slot:
        """A usable instance, a free one first."""
        with self._lock:
            usable = [s for s in self._slots if s.usable]
        if not usable:
            raise ModelUnavailable(self.unready_reason)
        free = [s for s in usable if s.state is SlotState.FREE]
        return (free or usable)[0]

    def split(self, output: Batch, count: int) -> list[Any]:
        """Per request: its checked outputs, ``Failed``, or (a decoupled model) its
        ``ResponseStream``, each response to be checked as it is read."""
        payloads, results = output
        return [self._checked(p, r) for p, r in zip(payloads, results, strict=True)]

    def _checked(self, payload: TensorPayload, result: Any) -> Any:
        if not isinstance(result, ResponseStream):
            return self._check(payload, result)
        result.check = lambda outputs: self._check(payload, outputs)
        return result

    # --- BLS (another model's instance thread) -------------------------------------

    def call(self, payload: TensorPayload) -> list[dict[str, np.ndarray[Any, Any]]]:
        """Run one checked request now, outside the batcher: a BLS call from another
        model's ``execute``, on that model's instance thread. Its responses' outputs
        (a decoupled model's, all of them once it sent its final flag), checked as a
        batch's are; raises its ``CarpoolError``."""
        try:
            _, results = self.forward([payload])
        except CarpoolError:
            raise
        except Exception as exc:
            log.error("model %s failed on a BLS request", self.spec.name, exc_info=exc)
            raise ModelExecutionError(
                f"model '{self.spec.name}' failed: {type(exc).__name__}: {exc}"
            ) from None
        checked = self._checked(payload, results[0])
        if isinstance(checked, ResponseStream):
            return checked.collect(self.timeout_s or None)
        if isinstance(checked, Failed):
            raise checked.error
        outputs: dict[str, np.ndarray[Any, Any]] = checked
        return [outputs]

    # --- control ------------------------------------------------------------------

    def finalize(self, timeout_s: float = FINALIZE_TIMEOUT_S) -> None:
        """Release every instance, waiting at most ``timeout_s`` for them all (a
        worker process that overruns its own wait is killed; an in-process
        ``finalize`` that overruns is left on its daemon thread; a hung instance's is
        never called). Any thread."""
        with self._lock:
            slots = list(self._slots)
        running: list[Future[None]] = []
        for slot in slots:
            slot.thread.stop()
            if isinstance(slot.backend, ProcessBackend) or slot.state is not SlotState.REPLACING:
                running.append(_answer(slot.backend.finalize))
        done, late = concurrent.futures.wait(running, timeout_s)
        for future in done:
            if future.exception() is not None:
                log.error("model %s: finalize failed: %s", self.spec.name, future.exception())
        if late:
            log.error(
                "model %s: %d instance(s) did not finalize within %gs",
                self.spec.name,
                len(late),
                timeout_s,
            )

    def _check(self, payload: TensorPayload, result: Outputs | Failed) -> Any:
        if isinstance(result, Failed):
            return result
        wanted = payload.outputs or tuple(t.name for t in self.spec.outputs)
        size = _batch_size(self.spec, payload)
        checked: dict[str, np.ndarray[Any, Any]] = {}
        for name in wanted:
            value = _as_declared(result.get(name), self.spec.output(name))
            error = self._output_error(name, value, size)
            if error:
                log.error("%s", error)
                return Failed(ModelExecutionError(error))
            checked[name] = with_bytes(value)
        parameters = parameters_of(result)
        error = _parameters_error(self.spec.name, parameters)
        if error:
            log.error("%s", error)
            return Failed(ModelExecutionError(error))
        return ModelAnswer(checked, parameters)

    def _output_error(self, name: str, value: Any, size: int | None) -> str:
        spec = self.spec.output(name)
        model = self.spec.name
        if spec is None:
            return f"model '{model}' has no output '{name}'"
        if value is None:
            return f"model '{model}' returned no output '{name}'"
        if not isinstance(value, np.ndarray):
            kind = type(value).__name__
            return f"model '{model}' returned output '{name}' as {kind}, not a numpy array"
        datatype = datatype_of(value)
        if datatype != spec.datatype:
            return (
                f"model '{model}' returned output '{name}' as {datatype or value.dtype}, "
                f"where its config declares {spec.datatype}"
            )
        shape = tuple(value.shape)
        if size is not None:
            if not shape or shape[0] != size:
                return (
                    f"model '{model}' returned output '{name}' with shape {list(shape)} for a "
                    f"request of batch size {size}"
                )
            shape = shape[1:]
        if not spec.shape_fits(shape):
            return (
                f"model '{model}' returned output '{name}' with shape {list(value.shape)}, "
                f"where its config declares {list(spec.dims)}"
            )
        return ""


def _as_declared(value: Any, spec: TensorSpec | None) -> Any:
    """An integer output in its declared integer datatype when every value fits
    (Triton's examples add an int64 to an INT32 output, and Triton passes it on).
    Anything else, floats of another width included, is left for the check to refuse."""
    if spec is None or not isinstance(value, np.ndarray) or datatype_of(value) == spec.datatype:
        return value
    declared = numpy_dtype(spec.datatype)
    kind, want = value.dtype.kind, declared.kind
    if kind in "iu" and want in "iu":
        info = np.iinfo(declared)
        if value.size == 0 or (info.min <= value.min() and value.max() <= info.max):
            return value.astype(declared)
    return value


class InstanceThread:
    """One model instance's own daemon thread: it runs what it is handed, in order. A
    daemon, so an instance hung in user code never holds up the server's exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._main, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((lambda: fn(*args), future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as exc:
                future.set_exception(exc)


def _execute(backend: Backend, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
    """``backend.execute`` (a worker process waited on without a limit: the batcher
    kills it past the execution timeout). ``SystemExit`` and the like raised by user
    code fail the batch; they never end the instance's thread."""
    try:
        if isinstance(backend, ProcessBackend):
            return backend.execute(payloads, None)
        return backend.execute(payloads)
    except Exception:
        raise
    except BaseException as exc:
        raise ModelExecutionError(f"the model raised {type(exc).__name__}") from None


def _ask_ready(backend: Any, timeout_s: float) -> bool:
    """One instance's ``is_ready`` answer (a worker process's within ``timeout_s``)."""
    if isinstance(backend, ProcessBackend):
        return backend.is_ready(timeout_s)
    return bool(backend.is_ready())


def _answer(fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on a daemon thread of its own; the future of its value."""
    future: Future[T] = Future()

    def main() -> None:
        try:
            value = fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(value)

    threading.Thread(target=main, name="carpool-model-call", daemon=True).start()
    return future


def _batch_size(spec: ModelSpec, payload: TensorPayload) -> int | None:
    if spec.max_batch_size == 0:
        return None
    return next(iter(payload.inputs.values())).shape[0] if payload.inputs else None


def _parameters_error(model: str, parameters: dict[str, Any]) -> str:
    """What is wrong with a response's parameters ("" if nothing): each a string,
    integer, float or boolean, as both protocols carry them."""
    for key, value in parameters.items():
        if not isinstance(value, str | int | float | bool):
            kind = type(value).__name__
            return (
                f"model '{model}' set response parameter '{key}' to a {kind}; parameters "
                "are strings, integers, floats or booleans"
            )
    return ""
