"""Triton's two model formats after Python: ONNX Runtime (``model.onnx``) and
TorchScript (``model.pt``). No user code runs: a batch's requests are stacked along
the batch dimension (the batcher groups equal trailing shapes), the graph runs once,
and its outputs are split back by each request's rows. A model without batching
(``max_batch_size: 0``) runs each request alone, as Triton's default scheduler does.

``complete_onnx_config`` is Triton's auto-complete for ONNX models: inputs, outputs
and batching read from the graph where the config leaves them out.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from carpool.batching.request import Failed
from carpool.errors import ModelExecutionError
from carpool.repository.errors import RepositoryError
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec

Arrays = dict[str, np.ndarray[Any, Any]]

# Triton's default-max-batch-size: what auto-complete gives a model that can batch.
DEFAULT_MAX_BATCH_SIZE = 4

# onnxruntime's element types as Triton's config names them.
ONNX_TYPES = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise RepositoryError("an ONNX model needs onnxruntime (pip install onnxruntime)") from None
    return onnxruntime


def run_stacked(
    payloads: Sequence[TensorPayload], spec: ModelSpec, run: Callable[[Arrays], Arrays]
) -> list[Arrays | Failed]:
    """Each payload's outputs: one ``run`` over the stacked batch, or one per payload
    for a model without batching."""
    if spec.max_batch_size == 0:
        return [run(dict(p.inputs)) for p in payloads]
    names = [t.name for t in spec.inputs if t.name in payloads[0].inputs]
    stacked = {n: np.concatenate([p.inputs[n] for p in payloads]) for n in names}
    rows = [len(p.inputs[names[0]]) for p in payloads]
    outputs = run(stacked)
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or len(array) != total:
            raise ModelExecutionError(
                f"model '{spec.name}' output '{name}' has {array.shape[:1] or 'no'} rows for "
                f"a batch of {total}"
            )
    bounds = np.cumsum([0, *rows])
    return [
        {name: array[start:end] for name, array in outputs.items()}
        for start, end in itertools.pairwise(bounds)
    ]


def _refuse_datatypes(spec: ModelSpec, refused: set[str], backend: str) -> None:
    for tensor in (*spec.inputs, *spec.outputs):
        if tensor.datatype in refused:
            raise RepositoryError(
                f"model '{spec.name}': {tensor.name} of {tensor.datatype} is not supported by "
                f"carpool's {backend} backend"
            )


class OnnxBackend:
    """An ONNX model in onnxruntime: the CPU execution provider (CUDA's where the
    server runs on a GPU and onnxruntime has it), ``threads`` intra-op threads."""

    def __init__(self, spec: ModelSpec, instance: int, device: str, threads: int = 1) -> None:
        ort = _onnxruntime()

        _refuse_datatypes(spec, {"BF16"}, "onnxruntime")
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = ort.InferenceSession(spec.source.path, options, providers=providers)
        except Exception as exc:
            raise RepositoryError(f"model '{spec.name}': {exc}") from None
        graph_inputs = {i.name for i in self.session.get_inputs()}
        graph_outputs = {o.name for o in self.session.get_outputs()}
        for tensor, known, kind in [
            *((t, graph_inputs, "input") for t in spec.inputs),
            *((t, graph_outputs, "output") for t in spec.outputs),
        ]:
            if tensor.name not in known:
                raise RepositoryError(
                    f"model '{spec.name}': the graph has no {kind} '{tensor.name}' (it has "
                    f"{', '.join(sorted(known))})"
                )
        self.spec = spec
        self.outputs = [t.name for t in spec.outputs]
        self.strings = {t.name for t in spec.inputs if t.datatype == "BYTES"}

    def execute(self, payloads: list[TensorPayload]) -> list[Arrays | Failed]:
        return run_stacked(payloads, self.spec, self._run)

    def _run(self, inputs: Arrays) -> Arrays:
        feed = {
            name: (_as_str(array) if name in self.strings else array)
            for name, array in inputs.items()
        }
        try:
            results = self.session.run(self.outputs, feed)
        except Exception as exc:
            raise ModelExecutionError(f"model '{self.spec.name}' failed: {exc}") from None
        return {name: _as_bytes(array) for name, array in zip(self.outputs, results, strict=True)}

    def finalize(self) -> None:
        del self.session


def _as_str(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A BYTES tensor as onnxruntime's string tensor."""
    return np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[np.object_])(array)


def _as_bytes(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if array.dtype != np.object_:
        return array
    return np.vectorize(lambda s: s.encode() if isinstance(s, str) else s, otypes=[np.object_])(
        array
    )


class TorchScriptBackend:
    """A TorchScript module (``torch.jit.save``), run under ``inference_mode`` on the
    server's device. Inputs are passed in Triton's order: by the ``__<index>`` of
    their names (``INPUT__0``, ...), else by the names of ``forward``'s arguments,
    else in the config's order; the module's outputs (a tensor, a tuple or a dict)
    are named likewise."""

    def __init__(self, spec: ModelSpec, instance: int, device: str) -> None:
        import torch

        _refuse_datatypes(spec, {"BYTES"}, "TorchScript")
        try:
            with warnings.catch_warnings():
                # torch deprecates TorchScript; Triton repositories still hold it.
                warnings.simplefilter("ignore", DeprecationWarning)
                self.module = torch.jit.load(spec.source.path, map_location=device).eval()
        except Exception as exc:
            raise RepositoryError(f"model '{spec.name}': {exc}") from None
        arguments = [a.name for a in self.module.forward.schema.arguments[1:]]
        self.inputs = _ordered([t.name for t in spec.inputs], arguments)
        self.outputs = _ordered([t.name for t in spec.outputs], [])
        self.spec = spec
        self.device = device

    def execute(self, payloads: list[TensorPayload]) -> list[Arrays | Failed]:
        return run_stacked(payloads, self.spec, self._run)

    def _run(self, inputs: Arrays) -> Arrays:
        import torch

        try:
            with torch.inference_mode():
                args = [_to_torch(inputs[name], self.device) for name in self.inputs]
                result = self.module(*args)
        except Exception as exc:
            raise ModelExecutionError(f"model '{self.spec.name}' failed: {exc}") from None
        if isinstance(result, dict):
            return {name: _to_numpy(result[name]) for name in self.outputs if name in result}
        results = result if isinstance(result, tuple | list) else (result,)
        if len(results) != len(self.outputs):
            raise ModelExecutionError(
                f"model '{self.spec.name}' returned {len(results)} outputs; its config "
                f"declares {len(self.outputs)}"
            )
        return {name: _to_numpy(t) for name, t in zip(self.outputs, results, strict=True)}

    def finalize(self) -> None:
        del self.module


def _to_torch(array: np.ndarray[Any, Any], device: str) -> Any:
    import torch

    # A writable copy only where needed: a request's arrays may be read-only views.
    if array.dtype == ml_dtypes.bfloat16:
        tensor = torch.from_numpy(np.require(array.view(np.int16), requirements=["C", "W"]))
        return tensor.view(torch.bfloat16).to(device)
    return torch.from_numpy(np.require(array, requirements=["C", "W"])).to(device)


def _to_numpy(tensor: Any) -> np.ndarray[Any, Any]:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ModelExecutionError(f"a TorchScript model returned a {type(tensor).__name__}")
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _ordered(names: list[str], arguments: list[str]) -> list[str]:
    """``names`` in the order Triton's PyTorch backend passes them."""
    indexed = [n.rpartition("__")[2] for n in names]
    if all("__" in n and i.isdigit() for n, i in zip(names, indexed, strict=True)):
        return [n for _, n in sorted(zip(map(int, indexed), names, strict=True))]
    if arguments and set(names) <= set(arguments):
        return sorted(names, key=arguments.index)
    return names


def complete_onnx_config(config: dict[str, Any], model_file: Path, where: str) -> dict[str, Any]:
    """Triton's auto-complete of an ONNX model: the graph's inputs and outputs where
    the config declares none, and, for a graph whose every tensor has a free first
    dimension, ``max_batch_size`` 4 with dynamic batching where the config sets
    neither."""
    ort = _onnxruntime()

    try:
        session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise RepositoryError(f"{where}: cannot read {model_file}: {exc}") from None
    tensors = [*session.get_inputs(), *session.get_outputs()]
    completed = dict(config)
    batching = int(config.get("max_batch_size", 0))
    can_batch = all(t.shape and not isinstance(t.shape[0], int) for t in tensors)
    if "max_batch_size" not in config and can_batch:
        batching = DEFAULT_MAX_BATCH_SIZE
        completed["max_batch_size"] = batching
        completed.setdefault("dynamic_batching", {})
    for key, found in (("input", session.get_inputs()), ("output", session.get_outputs())):
        if not config.get(key):
            completed[key] = [_onnx_tensor(t, batching > 0, where) for t in found]
    return completed


def _onnx_tensor(tensor: Any, batched: bool, where: str) -> dict[str, Any]:
    data_type = ONNX_TYPES.get(tensor.type)
    if data_type is None:
        raise RepositoryError(f"{where}: '{tensor.name}' has type {tensor.type}, not a tensor")
    dims = [d if isinstance(d, int) and d > 0 else -1 for d in tensor.shape]
    return {"name": tensor.name, "data_type": data_type, "dims": dims[1:] if batched else dims}
