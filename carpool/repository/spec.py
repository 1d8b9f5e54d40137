"""What a repository model declares: its tensors, its batching, where its code is.

``ModelSpec`` is what both layouts (Triton's ``config.pbtxt``, carpool's
``carpool.toml``) are read into; everything after reading works on it alone.
Pure: no torch, no user code.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from carpool.config import BatchingConfig
from carpool.errors import InvalidRequest
from carpool.repository.datatypes import config_name, numpy_dtype
from carpool.repository.ensemble import EnsembleStep

# Where a model instance runs: in the server's process, or a worker process of its own.
ISOLATIONS = ("", "thread", "process")


@dataclass(frozen=True)
class TensorSpec:
    """One declared input or output. ``dims`` exclude the batch dimension (as in
    Triton's config); -1 is any size."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    allow_ragged_batch: bool = False
    optional: bool = False

    def shape_fits(self, shape: tuple[int, ...]) -> bool:
        """Whether ``shape`` (without the batch dimension) matches ``dims``."""
        return len(shape) == len(self.dims) and all(
            d == -1 or d == s for d, s in zip(self.dims, shape, strict=True)
        )


@dataclass(frozen=True)
class Source:
    """Where a model's code comes from.

    ``kind``: ``triton_python`` (a ``TritonPythonModel`` in ``path``), ``python_class``
    (``target`` is ``module:Class``, imported with ``path`` on ``sys.path``).
    """

    kind: str
    path: str
    target: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    """A repository model, whichever layout it came from.

    ``max_batch_size`` 0 means the model does not batch: requests carry no batch
    dimension and run one at a time (Triton's meaning). Without ``dynamic_batching``
    requests carry a batch dimension but each runs alone, as under Triton's
    default scheduler. ``model_config`` is the config as JSON (Triton's
    ``args["model_config"]`` and ``GET .../config``). ``isolation``: ``thread`` (in the
    server's process) or ``process`` (a worker process per instance); empty: the
    server's default. ``decoupled``: the model answers each request through its
    response sender, with any number of responses (``decoupled``). ``ensemble``: an
    ensemble's steps in stages (``repository.ensemble``); it has no code of its own.
    """

    name: str
    version: int
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig
    source: Source
    dynamic_batching: bool = True
    instance_count: int = 1
    execution_timeout_s: float = 0.0
    isolation: str = ""
    model_config: Mapping[str, Any] = field(default_factory=dict)
    decoupled: bool = False
    ensemble: tuple[tuple[EnsembleStep, ...], ...] = ()

    @property
    def ragged(self) -> bool:
        """Whether requests of different shapes may share a batch."""
        return any(t.allow_ragged_batch for t in self.inputs)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


def config_tensor(tensor: TensorSpec) -> dict[str, Any]:
    """One tensor as Triton's config JSON writes it (``input`` / ``output`` entries)."""
    return {
        "name": tensor.name,
        "data_type": config_name(tensor.datatype),
        "dims": list(tensor.dims),
        **({"allow_ragged_batch": True} if tensor.allow_ragged_batch else {}),
        **({"optional": True} if tensor.optional else {}),
    }


def triton_view(
    name: str,
    backend: str,
    max_batch_size: int,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    instance_count: int,
    batching: BatchingConfig,
) -> dict[str, Any]:
    """A model not read from a config.pbtxt, in Triton's config JSON shape (what
    ``GET /v2/models/NAME/config`` answers and a Python-backend model would read)."""

    return {
        "name": name,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "input": [config_tensor(t) for t in inputs],
        "output": [config_tensor(t) for t in outputs],
        "instance_group": [{"name": name, "kind": "KIND_CPU", "count": instance_count}],
        "dynamic_batching": {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(batching.max_queue_delay_ms * 1000),
            "priority_levels": batching.priority_levels,
            "default_priority_level": batching.default_priority_level,
        },
    }


@dataclass(frozen=True)
class CheckedRequest:
    """A request's inputs after ``check_inputs``: the arrays, the batch slots they
    take, the batching group (equal shapes), and the cost (elements) for the budget."""

    arrays: dict[str, np.ndarray[Any, Any]]
    size: int
    group: Hashable
    cost: int


def check_unique(names: Sequence[str], noun: str = "input") -> None:
    """``InvalidRequest`` naming the first ``noun`` a request gives twice (Triton refuses
    a repeated input or output name). Linear in the names: a request may carry
    thousands of them."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidRequest(f"{noun} '{name}' is given twice", param=name)
        seen.add(name)


def check_inputs(spec: ModelSpec, arrays: Mapping[str, np.ndarray[Any, Any]]) -> CheckedRequest:
    """Check a request's decoded inputs against ``spec``: names, datatypes, shapes and
    the batch dimension. Raises ``InvalidRequest`` naming the input."""
    declared = {t.name: t for t in spec.inputs}
    for name in arrays:
        if name not in declared:
            raise InvalidRequest(
                f"unexpected input '{name}'; model '{spec.name}' takes "
                f"{', '.join(sorted(declared))}",
                param=name,
            )
    size = 1
    batch: int | None = None
    group: list[tuple[str, tuple[int, ...]]] = []
    cost = 0
    for tensor in spec.inputs:
        array = arrays.get(tensor.name)
        if array is None:
            if not tensor.optional:
                raise InvalidRequest(f"input '{tensor.name}' is missing", param=tensor.name)
            continue
        if array.dtype != numpy_dtype(tensor.datatype):
            raise InvalidRequest(
                f"input '{tensor.name}' must be {tensor.datatype}", param=tensor.name
            )
        shape = tuple(array.shape)
        if spec.max_batch_size > 0:
            if not shape or shape[0] < 1:
                raise InvalidRequest(
                    f"input '{tensor.name}' needs a batch dimension of at least 1 "
                    f"(shape [batch, {', '.join(map(str, tensor.dims))}])",
                    param=tensor.name,
                )
            if batch is not None and shape[0] != batch:
                raise InvalidRequest(
                    f"input '{tensor.name}' has batch size {shape[0]}, other inputs {batch}",
                    param=tensor.name,
                )
            batch = shape[0]
            if batch > spec.max_batch_size:
                raise InvalidRequest(
                    f"input '{tensor.name}' has batch size {batch}, over the model's "
                    f"max_batch_size {spec.max_batch_size}",
                    param=tensor.name,
                )
            shape = shape[1:]
        if not tensor.shape_fits(shape):
            raise InvalidRequest(
                f"input '{tensor.name}' has shape {list(shape)} where the model expects "
                f"{list(tensor.dims)}"
                + (" after the batch dimension" if spec.max_batch_size else ""),
                param=tensor.name,
            )
        if not tensor.allow_ragged_batch:
            group.append((tensor.name, shape))
        cost += max(1, math.prod(array.shape))
    if batch is not None:
        size = batch
    # A model that does not batch runs each request alone: no two share a group.
    alone = spec.max_batch_size == 0 or not spec.dynamic_batching
    key: Hashable = object() if alone else tuple(group)
    return CheckedRequest(dict(arrays), size, key, cost)
