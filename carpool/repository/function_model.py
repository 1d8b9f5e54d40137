"""A plain Python function as a served model, batched by carpool's policy (in the
spirit of PyTriton's ``@batch`` and LitServe's ``LitAPI``).

```python
import numpy as np
import carpool

@carpool.batched(inputs={"x": ("FP32", [4])}, outputs={"y": ("FP32", [4])},
                 max_batch_size=64, max_queue_delay_ms=2)
def double(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"y": x * 2}          # x: every request's rows, stacked

carpool.serve(double)            # /v2/models/double/infer, tritonclient works
```

The function gets each input as one array, the requests of the batch stacked along
the first axis (only equal shapes share a batch), and returns a dict of arrays with
as many rows; carpool hands each request its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carpool.batching.request import Failed
from carpool.config import BatchingConfig
from carpool.errors import ModelExecutionError
from carpool.repository.datatypes import DATATYPES
from carpool.repository.litapi import TENSORS as LITAPI_TENSORS
from carpool.repository.litapi import LitApiRunner, require_lit_api
from carpool.repository.payload import TensorPayload
from carpool.repository.spec import ModelSpec, Source, TensorSpec, triton_view

Outputs = dict[str, np.ndarray[Any, Any]]
TensorDecl = Mapping[str, tuple[str, Sequence[int]]]


@dataclass(frozen=True)
class FunctionModel:
    """A function and how it is served; what ``batched`` returns, what ``serve`` takes."""

    fn: Callable[..., Mapping[str, np.ndarray[Any, Any]]]
    spec: ModelSpec

    def __call__(self, **inputs: np.ndarray[Any, Any]) -> Mapping[str, np.ndarray[Any, Any]]:
        return self.fn(**inputs)

    def backend(self) -> FunctionBackend:
        """What runs it on the runtime's batches (in the server's process)."""
        return FunctionBackend(self)


@dataclass(frozen=True)
class LitApiModel:
    """A LitServe ``LitAPI`` instance served in the server's process, as
    ``carpool.serve(api)`` takes it (LitServe's ``LitServer(api)``)."""

    api: Any
    spec: ModelSpec
    device: str = "cpu"

    def backend(self) -> LitApiRunner:
        """What runs it (its ``setup(device)`` is called here, once)."""
        return LitApiRunner(self.api, self.spec, self.device)


InProcessModel = FunctionModel | LitApiModel


def lit_api(
    api: Any,
    *,
    name: str | None = None,
    max_batch_size: int | None = None,
    batch_timeout: float | None = None,
    device: str = "cpu",
) -> LitApiModel:
    """``api`` (an object with LitServe's ``decode_request``, ``predict`` and
    ``encode_response``) as a served model at ``/predict``. ``max_batch_size`` and
    ``batch_timeout`` (seconds) are LitServe's; left out, the ones the instance
    carries (a ``litserve.LitAPI`` made with them), else 1 and 0."""
    require_lit_api(api)
    size = max_batch_size if max_batch_size is not None else getattr(api, "max_batch_size", 1)
    wait = batch_timeout if batch_timeout is not None else getattr(api, "batch_timeout", 0.0)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, not {size!r}")
    if not isinstance(wait, int | float) or wait < 0:
        raise ValueError(f"batch_timeout must be seconds >= 0, not {wait!r}")
    batching = BatchingConfig(
        max_batch_size=size, max_queue_delay_ms=float(wait) * 1000, max_batch_tokens=1 << 62
    )
    spec = _in_process_spec(name or type(api).__name__, "litapi", *LITAPI_TENSORS, batching)
    return LitApiModel(api, spec, device)


def _in_process_spec(
    name: str,
    kind: str,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    batching: BatchingConfig,
    execution_timeout_s: float = 0.0,
) -> ModelSpec:
    """The spec of a model served in the server's process (``kind``: its source)."""
    size = batching.max_batch_size
    return ModelSpec(
        name=name,
        version=1,
        max_batch_size=size,
        inputs=inputs,
        outputs=outputs,
        batching=batching,
        source=Source(kind, ""),
        execution_timeout_s=execution_timeout_s,
        isolation="thread",
        model_config=triton_view(name, f"carpool-{kind}", size, inputs, outputs, 1, batching),
    )


def _tensors(declared: TensorDecl, where: str) -> tuple[TensorSpec, ...]:
    specs = []
    for name, (datatype, dims) in declared.items():
        if datatype not in DATATYPES:
            raise ValueError(f"{where} '{name}': datatype {datatype!r} is not one of {DATATYPES}")
        specs.append(TensorSpec(name, datatype, tuple(int(d) for d in dims)))
    if not specs:
        raise ValueError(f"a batched function needs at least one {where}")
    return tuple(specs)


def batched(
    *,
    inputs: TensorDecl,
    outputs: TensorDecl,
    name: str | None = None,
    max_batch_size: int = 64,
    max_queue_delay_ms: float = 0.0,
    preferred_batch_sizes: Sequence[int] = (),
    execution_timeout_s: float = 0.0,
) -> Callable[[Callable[..., Any]], FunctionModel]:
    """Declare a function's tensors (name -> (datatype, dims without the batch
    dimension)) and batching; the decorated function becomes a ``FunctionModel``."""

    def wrap(fn: Callable[..., Any]) -> FunctionModel:
        model_name = name or fn.__name__
        ins, outs = _tensors(inputs, "input"), _tensors(outputs, "output")
        batching = BatchingConfig(
            max_batch_size=max_batch_size,
            max_queue_delay_ms=max_queue_delay_ms,
            preferred_batch_sizes=tuple(preferred_batch_sizes),
            max_batch_tokens=1 << 62,
        )
        spec = _in_process_spec(model_name, "function", ins, outs, batching, execution_timeout_s)
        return FunctionModel(fn, spec)

    return wrap


class FunctionBackend:
    """Runs a ``FunctionModel`` on a stacked batch and cuts its rows back apart."""

    def __init__(self, model: FunctionModel) -> None:
        self.model = model

    def execute(self, payloads: list[TensorPayload]) -> list[Outputs | Failed]:
        names = [t.name for t in self.model.spec.inputs]
        rows = [len(next(iter(p.inputs.values()))) for p in payloads]
        stacked = {n: np.concatenate([p.inputs[n] for p in payloads]) for n in names}
        result = self.model.fn(**stacked)
        if not isinstance(result, Mapping):
            raise ModelExecutionError(
                f"function '{self.model.spec.name}' returned a {type(result).__name__}, "
                "not a dict of arrays"
            )
        total = sum(rows)
        out: list[Outputs | Failed] = []
        start = 0
        for count in rows:
            out.append(
                {
                    k: v[start : start + count]
                    for k, v in result.items()
                    if isinstance(v, np.ndarray) and len(v) == total
                }
            )
            start += count
        return out

    def finalize(self) -> None:
        return None
