"""A compatible ``triton_python_backend_utils``: the parts Python-backend models use.

A Triton Python-backend ``model.py`` does ``import triton_python_backend_utils as
pb_utils``; carpool puts this module under that name before it imports a model, so
the file is served unchanged. Tensors live on the host as numpy arrays (DLPack
round-trips through torch where a model asks for it). ``ModelConfig`` is what
``auto_complete_config`` gets; ``InferenceRequest.exec`` / ``async_exec`` call
another served model (BLS, see ``bls``); a decoupled model's requests carry an
``InferenceResponseSender`` (``decoupled``); ``exec(decoupled=True)`` calls one and
iterates its responses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from carpool.errors import CarpoolError, InvalidRequest, ModelNotFound, Overloaded
from carpool.repository import bls, user_metrics
from carpool.repository.datatypes import with_bytes
from carpool.repository.decoupled import ResponseStream
from carpool.repository.payload import parameters_of
from carpool.repository.spec import check_unique

log = logging.getLogger("carpool.user_model")

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2


class TritonModelException(Exception):
    """Raised by the shim for what carpool does not provide; a model may raise it too."""


class TritonError:
    """An error a model puts in a response: that request fails with ``message``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


class Tensor:
    """A named tensor; ``as_numpy`` is the data."""

    def __init__(self, name: str, data: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException("Tensor name must be a string")
        self._name = name
        self._array = with_bytes(np.asarray(data))

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> str:
        return str(np_to_triton_dtype(self._array.dtype))

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        import torch

        return torch.utils.dlpack.to_dlpack(torch.from_numpy(np.ascontiguousarray(self._array)))

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        import torch

        tensor = torch.utils.dlpack.from_dlpack(capsule)
        return Tensor(name, tensor.detach().cpu().numpy())

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class InferenceRequest:
    """One client request as a model's ``execute`` receives it, or a request a model
    makes of another model (BLS: ``model_name``, ``exec``)."""

    def __init__(
        self,
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str | bytes] | None = None,
        request_id: str = "",
        parameters: Mapping[str, Any] | str | None = None,
        model_name: str | bytes = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        model_version: int = -1,
        timeout: int = 0,
        preferred_memory: Any = None,
        *,
        response_sender: InferenceResponseSender | None = None,
    ) -> None:
        self._inputs = list(inputs or [])
        self._outputs = [
            n.decode() if isinstance(n, bytes) else n for n in requested_output_names or []
        ]
        self._id = request_id
        given = json.loads(parameters) if isinstance(parameters, str) else parameters
        self._parameters: dict[str, Any] = dict(given or {})
        # A name read from a BYTES tensor arrives as bytes (Triton's bls example).
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self._model_version = model_version
        self._correlation_id = correlation_id
        self._flags = flags
        self._sender = response_sender

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def parameters(self) -> str:
        """The request's parameters as a JSON string (Triton's form)."""
        return json.dumps(self._parameters)

    def model_name(self) -> str:
        return self._model_name

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "only a decoupled model's requests have a response sender (set "
                "model_transaction_policy { decoupled: true } in its config.pbtxt)"
            )
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on model ``model_name`` (BLS) and return its response; a
        failure is the response's ``error``, as in Triton. With ``decoupled``: an
        iterator over the (decoupled) model's responses, the last one empty (the final
        flag's), as Triton's."""
        current = bls.current()
        if current is None:
            raise TritonModelException(
                "BLS calls (InferenceRequest.exec) are made from a served model's execute"
            )
        caller, call = current
        version = str(self._model_version) if self._model_version > 0 else ""
        try:
            check_unique([t.name() for t in self._inputs])
            answers = call(
                caller,
                self._model_name,
                version,
                {t.name(): t.as_numpy() for t in self._inputs},
                tuple(self._outputs),
                self._parameters,
                decoupled,
            )
        except Exception as exc:
            failed = InferenceResponse(error=_error_of(exc))
            return iter([failed, InferenceResponse()]) if decoupled else failed
        responses = [
            InferenceResponse(
                [Tensor(name, array) for name, array in outputs.items()],
                parameters=parameters_of(outputs),
            )
            for outputs in answers
        ]
        return iter([*responses, InferenceResponse()]) if decoupled else responses[0]

    async def async_exec(self, decoupled: bool = False) -> Any:
        """``exec`` for an ``async def execute``: awaited, it runs on a helper thread."""
        return await asyncio.to_thread(self.exec, decoupled)


class InferenceResponseSender:
    """Sends a decoupled model's responses to one request: any number, from any
    thread, the last with ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` (alone or with a
    response)."""

    def __init__(
        self, stream: ResponseStream, outputs_of: Callable[[InferenceResponse], Any]
    ) -> None:
        self._stream = stream
        self._outputs_of = outputs_of
        self._lock = threading.Lock()
        self._final = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        with self._lock:
            if self._final:
                raise TritonModelException("the final response was already sent")
            if response is None and not flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                raise TritonModelException("send() needs a response or the final flag")
            if response is not None:
                self._stream.put(self._outputs_of(response))
            if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._final = True
                self._stream.finish()

    def is_cancelled(self) -> bool:
        """Whether the client has gone (sending more is then wasted work)."""
        return self._stream.cancelled


def _error_of(exc: Exception) -> TritonError:
    """A BLS call's failure as Triton reports it in the response."""
    message = exc.message if isinstance(exc, CarpoolError) else f"{type(exc).__name__}: {exc}"
    code = TritonError.INTERNAL
    if isinstance(exc, InvalidRequest):
        code = TritonError.INVALID_ARG
    elif isinstance(exc, ModelNotFound):
        code = TritonError.NOT_FOUND
    elif isinstance(exc, Overloaded):
        code = TritonError.UNAVAILABLE
    return TritonError(message, code)


class InferenceResponse:
    """A model's answer to one request: output tensors, or an error. ``parameters``
    (a dict, or its JSON text; strings, integers, floats or booleans) are sent to the
    client beside the outputs, over HTTP and gRPC, and read back with
    ``parameters()``."""

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        given = json.loads(parameters) if isinstance(parameters, str) else parameters
        self._parameters = dict(given or {})

    def parameters(self) -> str:
        """The response's parameters as JSON text (Triton's form)."""
        return json.dumps(self._parameters)

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """Whether ``model_config`` (the parsed ``args["model_config"]``) makes the model
    decoupled (``model_transaction_policy { decoupled: true }``)."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((dict(t) for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return next((dict(t) for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """``TYPE_FP32`` -> ``numpy.float32`` (and ``TYPE_STRING`` -> ``numpy.object_``)."""
    name = triton_type_string.removeprefix("TYPE_")
    return triton_to_np_dtype("BYTES" if name == "STRING" else name)


def numpy_to_triton_type(data_type: Any) -> str:
    return str(np_to_triton_dtype(np.dtype(data_type)))


class ModelConfig:
    """The configuration a model's ``auto_complete_config`` reads and completes (Triton's
    ``pb_utils.ModelConfig``): ``max_batch_size``, ``input``, ``output`` and the
    scheduler may be set; what the config file set already is checked, not replaced."""

    def __init__(self, model_config: dict[str, Any]) -> None:
        self._config = model_config
        self._config.setdefault("max_batch_size", 0)
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 0:
            raise ValueError(f"max_batch_size must be an integer >= 0, got {max_batch_size!r}")
        current = int(self._config.get("max_batch_size", 0))
        if current not in (0, max_batch_size):
            raise ValueError(
                f"the configuration sets max_batch_size {current}; auto-complete tried "
                f"to set {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(f"the configuration sets {other}; dynamic batching cannot be set")
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_model_warmup(self, model_warmup: dict[str, Any]) -> None:
        self._config.setdefault("model_warmup", []).append(dict(model_warmup))

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise ValueError(f"an {kind} must be a dict with a 'name'")
        known = next((t for t in self._config[kind] if t.get("name") == tensor["name"]), None)
        if known is None:
            self._config[kind].append(dict(tensor))
            return
        for key in ("data_type", "dims"):
            if key not in tensor:
                continue
            if key in known and known[key] != tensor[key]:
                raise ValueError(
                    f"{kind} '{tensor['name']}' has {key} {known[key]!r} in the configuration; "
                    f"auto-complete gave {tensor[key]!r}"
                )
            known[key] = tensor[key]


class MetricFamily:
    """Triton's custom metric family: a name, a description and a kind (``COUNTER``,
    ``GAUGE`` or ``HISTOGRAM``), exported on ``/metrics`` with carpool's own. A name
    used again with the same kind is the same family."""

    COUNTER = user_metrics.COUNTER
    GAUGE = user_metrics.GAUGE
    HISTOGRAM = user_metrics.HISTOGRAM

    def __init__(self, name: str, description: str, kind: str) -> None:
        try:
            self._family = user_metrics.REGISTRY.family(name, description, kind)
        except user_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None

    def Metric(
        self, labels: dict[str, str] | None = None, buckets: list[float] | None = None
    ) -> Metric:
        """The family's series with these ``labels`` (a histogram's with its
        ``buckets``)."""
        try:
            return Metric(self._family, self._family.series(labels, buckets))
        except user_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None


class Metric:
    """One labelled series of a ``MetricFamily``."""

    def __init__(self, family: user_metrics.Family, key: user_metrics.Labels) -> None:
        self._family = family
        self._key = key

    def increment(self, value: float) -> None:
        self._do(self._family.add, float(value))

    def set(self, value: float) -> None:
        self._do(self._family.set, float(value))

    def observe(self, value: float) -> None:
        self._do(self._family.observe, float(value))

    def value(self) -> float:
        try:
            return self._family.read(self._key)
        except user_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None

    def _do(self, action: Callable[[user_metrics.Labels, float], None], value: float) -> None:
        try:
            action(self._key, value)
        except user_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None


class Logger:
    """Triton's model logger, onto carpool's log."""

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        log.log(level, "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        log.debug("%s", message)
