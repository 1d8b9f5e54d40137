"""A repository model as the dynamic batcher's ``BatchModel``.

Each in-process instance of the user's model (``instance_group`` count) has its own
thread; the runtime thread hands a batch to the next instance and waits at most the
model's execution timeout. A process-isolated instance needs no thread of its own:
the calling thread sends the batch to its worker and waits on the pipe with the same
timeout (one hand-over fewer each way on every request). What comes back is checked
against the config: one result per request, every requested output there, with its
declared datatype and shape and the request's batch size. A wrong output fails that
request with a message that says what was wrong. A batch that outlives the timeout
fails whole; an in-process model is then marked unready (its thread cannot be taken
back), a process-isolated one has its worker restarted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NoReturn, TypeVar

import numpy as np

from carpool.batching.request import Failed
from carpool.errors import BatchFailed, CarpoolError, ModelExecutionError, ModelUnavailable
from carpool.repository.backends import Backend, Outputs
from carpool.repository.datatypes import datatype_of, with_bytes
from carpool.repository.decoupled import ResponseStream
from carpool.repository.payload import TensorPayload
from carpool.repository.process import ExecutionTimedOut, ProcessBackend
from carpool.repository.spec import ModelSpec

log = logging.getLogger(__name__)

T = TypeVar("T")
Batch = tuple[list[TensorPayload], list[Outputs | Failed]]


class UserBatchModel:
    """Runs batches of ``TensorPayload`` on the user's model instances."""

    def __init__(self, spec: ModelSpec, instances: Sequence[Backend], timeout_s: float) -> None:
        if not instances:
            raise ValueError("a model needs at least one instance")
        self.spec = spec
        self.ragged = spec.ragged
        self.timeout_s = timeout_s
        self.unready_reason = ""
        self._instances = list(instances)
        # A worker process is waited on from the calling thread: no thread of its own.
        self._threads = [
            None
            if isinstance(instance, ProcessBackend)
            else InstanceThread(f"carpool-{spec.name}-{i}")
            for i, instance in enumerate(instances)
        ]
        self._next = 0
        # Instances running a batch: the batcher may run as many batches at once as
        # there are instances (its dispatch threads), each on a free one.
        self._busy: set[int] = set()
        self._busy_lock = threading.Lock()

    @property
    def ready(self) -> bool:
        return not self.unready_reason

    # --- BatchModel (runtime thread) ---------------------------------------------

    def collate(self, payloads: list[TensorPayload]) -> list[TensorPayload]:
        return payloads

    @property
    def instance_count(self) -> int:
        return len(self._instances)

    def forward(self, payloads: list[TensorPayload]) -> Batch:
        """Run a batch on a free instance (the next in turn among the free ones) and
        wait for it; any thread, at most one batch per instance at once."""
        if self.unready_reason:
            raise BatchFailed(self.unready_reason)
        index, taken = self._take_instance()
        try:
            return payloads, self._run(index, payloads)
        finally:
            self._release(index, taken)

    def _run(self, index: int, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        """``payloads`` run on instance ``index`` within the execution timeout: on the
        instance's thread, or, for a worker process, from the calling thread."""
        instance = self._instances[index]
        timeout = self.timeout_s or None
        if isinstance(instance, ProcessBackend):
            try:
                return instance.execute(payloads, timeout)
            except ExecutionTimedOut:
                self._timed_out(restarted=True)
        thread = self._threads[index]
        assert thread is not None  # every in-process instance has one
        future = thread.submit(instance.execute, payloads)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            self._timed_out(restarted=False)

    def _take_instance(self) -> tuple[int, bool]:
        """The next free instance in turn, now marked busy (``True``); or, with none
        free, the next in turn, to queue behind its work (``False``: not marked)."""
        with self._busy_lock:
            count = len(self._instances)
            order = [(self._next + i) % count for i in range(count)]
            free = next((i for i in order if i not in self._busy), None)
            index = order[0] if free is None else free
            self._next = (index + 1) % count
            if free is not None:
                self._busy.add(index)
            return index, free is not None

    def _release(self, index: int, taken: bool) -> None:
        if taken:
            with self._busy_lock:
                self._busy.discard(index)

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

    def call(self, payload: TensorPayload) -> dict[str, np.ndarray[Any, Any]]:
        """Run one checked request now, outside the batcher: a BLS call from another
        model's ``execute``, made while the runtime waits on that model. Its outputs,
        checked as a batch's are; raises its ``CarpoolError``."""
        if self.unready_reason:
            raise ModelUnavailable(self.unready_reason)
        index, taken = self._take_instance()
        try:
            results = self._run(index, [payload])
        except CarpoolError:
            raise
        except Exception as exc:
            log.error("model %s failed on a BLS request", self.spec.name, exc_info=exc)
            raise ModelExecutionError(f"model '{self.spec.name}' failed on this request") from None
        finally:
            self._release(index, taken)
        checked = self._check(payload, results[0])
        if isinstance(checked, Failed):
            raise checked.error
        outputs: dict[str, np.ndarray[Any, Any]] = checked
        return outputs

    # --- control ------------------------------------------------------------------

    def finalize(self) -> None:
        """Release every instance; their threads end once idle (a hung one never does)."""
        for instance, thread in zip(self._instances, self._threads, strict=True):
            try:
                instance.finalize()
            except Exception:
                log.exception("model %s: finalize failed", self.spec.name)
            if thread is not None:
                thread.stop()

    def _timed_out(self, restarted: bool) -> NoReturn:
        """A batch outlived the execution timeout: ``BatchFailed``; a worker process
        has already been ``restarted``, an in-process model is marked unready."""
        message = (
            f"model '{self.spec.name}' did not finish a batch within its execution timeout "
            f"of {self.timeout_s:g}s"
        )
        if restarted:
            log.error("%s; its worker process is being restarted", message)
        else:
            log.error("%s; the model is marked unready (unload and load it to recover)", message)
            self.unready_reason = (
                f"model '{self.spec.name}' is unready: it hung past its execution timeout"
            )
        raise BatchFailed(message)

    def _check(self, payload: TensorPayload, result: Outputs | Failed) -> Any:
        if isinstance(result, Failed):
            return result
        wanted = payload.outputs or tuple(t.name for t in self.spec.outputs)
        size = _batch_size(self.spec, payload)
        checked: dict[str, np.ndarray[Any, Any]] = {}
        for name in wanted:
            error = self._output_error(name, result.get(name), size)
            if error:
                log.error("%s", error)
                return Failed(ModelExecutionError(error))
            checked[name] = with_bytes(result[name])
        return checked

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
            except Exception as exc:
                future.set_exception(exc)
            except BaseException as exc:
                # SystemExit and the like from user code must not reach the runtime
                # thread (where they would stop it): they fail this batch.
                future.set_exception(ModelExecutionError(f"the model raised {type(exc).__name__}"))


def _batch_size(spec: ModelSpec, payload: TensorPayload) -> int | None:
    if spec.max_batch_size == 0:
        return None
    return next(iter(payload.inputs.values())).shape[0] if payload.inputs else None
