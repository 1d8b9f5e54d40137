"""The code a repository model runs: one class per source kind, each a ``Backend``.

A backend is one instance of the user's model. ``execute`` takes a batch of request
payloads and returns, per request, its outputs (name -> array) or ``Failed``. It runs
user code and trusts nothing about it beyond what ``user_model`` checks afterwards.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from carpool.batching.request import Failed
from carpool.errors import InvalidRequest, ModelExecutionError
from carpool.repository import bls, pb_utils
from carpool.repository.decoupled import ResponseStream
from carpool.repository.errors import RepositoryError
from carpool.repository.library_models import (
    CrossEncoderBackend,
    PipelineBackend,
    SentenceTransformerBackend,
)
from carpool.repository.litapi import LitApiRunner
from carpool.repository.payload import ModelAnswer, TensorPayload
from carpool.repository.spec import ModelSpec
from carpool.repository.tensor_backends import OnnxBackend, TorchScriptBackend

Outputs = dict[str, np.ndarray[Any, Any]]
log = logging.getLogger(__name__)


class Backend(Protocol):
    """One loaded instance of a user's model."""

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        """Run one batch; one result per payload, in order."""

    def finalize(self) -> None:
        """Release the model (unload)."""


@contextmanager
def _on_path(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while a model's code is imported, so it can
    import the modules beside it."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        with suppress(ValueError):
            sys.path.remove(str(folder))


def import_file(path: Path, module_name: str) -> ModuleType:
    # Python-backend models import the shim by Triton's name.
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RepositoryError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    with _on_path(path.parent):
        spec.loader.exec_module(module)
    return module


def _import_module(folder: Path, module_name: str, model: str) -> ModuleType:
    """``module_name`` from the model's folder, under a name of its own (two models'
    ``model.py`` must not share ``sys.modules["model"]``); else an installed module."""
    path = folder.joinpath(*module_name.split(".")).with_suffix(".py")
    if path.is_file():
        return import_file(path, f"carpool_user_{model}_{module_name}")
    with _on_path(folder):
        return importlib.import_module(module_name)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _call_hook(model: Any, name: str, argument: Any, where: str) -> None:
    """Call the model's optional ``name`` hook (initialize, setup) if it has one; what
    it raises, ``SystemExit`` included, is a ``RepositoryError``: the load fails."""
    hook = getattr(model, name, None)
    if hook is None:
        return
    try:
        hook(argument)
    except (Exception, SystemExit) as exc:
        raise RepositoryError(f"{where}: {name} failed: {describe(exc)}") from exc


def _one_per_request(results: Any, count: int, model: str, noun: str) -> None:
    """Refuse, as the batch's ``ModelExecutionError``, anything but a list or tuple of
    ``count`` results."""
    if isinstance(results, list | tuple) and len(results) == count:
        return
    got = len(results) if isinstance(results, list | tuple) else type(results).__name__
    raise ModelExecutionError(f"model '{model}' returned {got} {noun} for {count} requests")


class TritonPythonBackend:
    """A ``TritonPythonModel`` from a Python-backend ``model.py``; ``call_model`` serves
    its BLS calls (``InferenceRequest.exec``). An ``async def execute`` is run to its
    end on the instance's thread."""

    def __init__(
        self, spec: ModelSpec, instance: int, device: str, call_model: bls.CallModel | None = None
    ) -> None:
        path = Path(spec.source.path)
        where = f"model '{spec.name}' version {spec.version}"
        try:
            module = import_file(path, f"carpool_user_{spec.name}_{spec.version}_{instance}")
            self.model = module.TritonPythonModel()
        except (Exception, SystemExit) as exc:
            raise RepositoryError(f"{where}: loading {path} failed: {describe(exc)}") from exc
        self.spec = spec
        self.call_model = call_model
        kind = "GPU" if device.startswith("cuda") else "CPU"
        args = {
            "model_config": json.dumps(spec.model_config),
            "model_instance_kind": kind,
            "model_instance_name": f"{spec.name}_0_{instance}",
            "model_instance_device_id": device.partition(":")[2] or "0",
            "model_repository": str(path.parent.parent),
            "model_version": str(spec.version),
            "model_name": spec.name,
        }
        _call_hook(self.model, "initialize", args, where)

    def execute(self, payloads: list[TensorPayload]) -> list[Any]:
        """One result per payload: its outputs or ``Failed``; for a decoupled model,
        its ``ResponseStream`` (the responses come through the request's sender)."""
        streams = [ResponseStream() for _ in payloads] if self.spec.decoupled else []
        requests = [
            pb_utils.InferenceRequest(
                [pb_utils.Tensor(name, array) for name, array in p.inputs.items()],
                list(p.outputs) or [t.name for t in self.spec.outputs],
                request_id=p.request_id,
                parameters=p.parameters,
                model_name=self.spec.name,
                response_sender=pb_utils.InferenceResponseSender(streams[i], self._outputs_of)
                if streams
                else None,
            )
            for i, p in enumerate(payloads)
        ]
        with bls.calling_as(self.spec.name, self.call_model):
            responses = self.model.execute(requests)
            if inspect.iscoroutine(responses):
                responses = asyncio.run(responses)
        if streams:
            if responses is not None:
                raise ModelExecutionError(
                    f"decoupled model '{self.spec.name}' returned responses from execute; "
                    "it must send them through each request's response sender and return None"
                )
            return list(streams)
        _one_per_request(responses, len(requests), self.spec.name, "responses")
        return [_outputs_of(r, self.spec.name) for r in responses]

    def _outputs_of(self, response: Any) -> Outputs | Failed:
        return _outputs_of(response, self.spec.name)

    @property
    def has_ready_hook(self) -> bool:
        return callable(getattr(self.model, "is_ready", None))

    def is_ready(self) -> bool:
        """The model's own ``is_ready`` (Triton's readiness hook; ``async def`` run to
        its end); anything but ``True`` is not ready, and so is a hook that raises."""
        try:
            answer = self.model.is_ready()
            if inspect.iscoroutine(answer):
                answer = asyncio.run(answer)
        except Exception as exc:
            log.warning("model %s: is_ready raised %s: %s", self.spec.name, type(exc).__name__, exc)
            return False
        return answer is True

    def finalize(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        if finalize is not None:
            finalize()


def _outputs_of(response: Any, model: str) -> Outputs | Failed:
    if not isinstance(response, pb_utils.InferenceResponse):
        return Failed(
            ModelExecutionError(
                f"model '{model}' returned a {type(response).__name__} where an "
                "InferenceResponse belongs"
            )
        )
    error = response.error()
    if error is None:
        outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        try:
            parameters = json.loads(response.parameters())
        except TypeError as exc:
            message = f"model '{model}' set response parameters that are not JSON: {exc}"
            return Failed(ModelExecutionError(message))
        return ModelAnswer(outputs, parameters)
    if not isinstance(error, pb_utils.TritonError):
        return Failed(ModelExecutionError(str(error)))
    # Triton answers a model's INVALID_ARG as the client's error (400), the rest as 500.
    if error.code() == pb_utils.TritonError.INVALID_ARG:
        return Failed(InvalidRequest(error.message()))
    return Failed(ModelExecutionError(error.message()))


class PythonClassBackend:
    """carpool's own interface: a class named ``module:Class`` in ``carpool.toml``.

    The class may define ``setup(device)``; it must define ``predict``. Without
    ``collate``, ``predict`` takes a list of input dicts (name -> array, the request's
    batch dimension first) and returns one output dict per input. With ``collate``
    and ``split``: ``predict(collate(inputs))`` and ``split(output, inputs)`` gives
    the per-input dicts. ``teardown()`` runs at unload.
    """

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        module_name, _, class_name = spec.source.target.partition(":")
        where = f"model '{spec.name}'"
        try:
            module = _import_module(Path(spec.source.path), module_name, spec.name)
            model_class = getattr(module, class_name)
            self.model = model_class(**dict(spec.source.options))
        except (Exception, SystemExit) as exc:
            raise RepositoryError(
                f"{where}: loading {spec.source.target} failed: {describe(exc)}"
            ) from exc
        if not callable(getattr(self.model, "predict", None)):
            raise RepositoryError(f"{where}: {spec.source.target} has no predict method")
        self.spec = spec
        _call_hook(self.model, "setup", device, where)

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        inputs = [dict(p.inputs) for p in payloads]
        collate = getattr(self.model, "collate", None)
        if collate is not None:
            results = self.model.split(self.model.predict(collate(inputs)), inputs)
        else:
            results = self.model.predict(inputs)
        _one_per_request(results, len(inputs), self.spec.name, "outputs")
        return [
            r
            if isinstance(r, dict)
            else Failed(
                ModelExecutionError(
                    f"model '{self.spec.name}' returned a {type(r).__name__} where a dict of "
                    "outputs belongs"
                )
            )
            for r in results
        ]

    def finalize(self) -> None:
        teardown = getattr(self.model, "teardown", None)
        if teardown is not None:
            teardown()


class LitApiBackend:
    """LitServe's ``LitAPI`` contract (``carpool.repository.litapi``): a class named
    ``module:Class`` in ``carpool.toml``, JSON in and out."""

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        module_name, _, class_name = spec.source.target.partition(":")
        try:
            module = _import_module(Path(spec.source.path), module_name, spec.name)
            api = getattr(module, class_name)(**dict(spec.source.options))
            self.runner = LitApiRunner(api, spec, device)
        except (Exception, SystemExit) as exc:
            raise RepositoryError(
                f"model '{spec.name}': loading {spec.source.target} failed: {describe(exc)}"
            ) from exc

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        return self.runner.execute(payloads)

    def finalize(self) -> None:
        self.runner.finalize()


def _onnx(spec: ModelSpec, instance: int, device: str) -> Backend:
    """onnxruntime with as many intra-op threads as torch has: carpool's core budget."""
    import torch

    return OnnxBackend(spec, instance, device, threads=torch.get_num_threads())


BACKENDS: dict[str, Callable[[ModelSpec, int, str], Backend]] = {
    "onnxruntime": _onnx,
    "torchscript": TorchScriptBackend,
    "python_class": PythonClassBackend,
    "litapi": LitApiBackend,
    "pipeline": PipelineBackend,
    "cross_encoder": CrossEncoderBackend,
    "sentence_transformer": SentenceTransformerBackend,
}


def create_backend(
    spec: ModelSpec, instance: int, device: str, call_model: bls.CallModel | None = None
) -> Backend:
    """Load instance ``instance`` of ``spec``'s model; ``RepositoryError`` if it fails.
    ``call_model`` serves a Python-backend model's BLS calls."""
    if spec.source.kind == "triton_python":
        return TritonPythonBackend(spec, instance, device, call_model)
    factory = BACKENDS.get(spec.source.kind)
    if factory is None:
        raise RepositoryError(f"model '{spec.name}': unknown source kind '{spec.source.kind}'")
    return factory(spec, instance, device)
