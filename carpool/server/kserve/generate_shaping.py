"""Triton's generate extension (``/v2/models/NAME/generate`` and ``generate_stream``)
in and out: a JSON object whose keys are the model's inputs (and ``parameters``),
answered by one whose keys are its outputs. Pure functions.

In: each value (a JSON scalar or a list, nested as the input's shape) becomes a
tensor of the input's datatype; a scalar is a tensor of one element; a model that
batches gets a batch dimension of 1 in front. Out: each output without that batch
dimension, a tensor of one element as a scalar, BYTES as text.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from carpool.errors import InvalidRequest
from carpool.repository.datatypes import numpy_dtype
from carpool.repository.spec import ModelSpec

RESERVED = ("parameters", "id")


def generate_inputs(
    body: Any, spec: ModelSpec
) -> tuple[dict[str, np.ndarray[Any, Any]], dict[str, Any]]:
    """The request's input tensors and its parameters; ``InvalidRequest`` naming the
    key that is not an input, or whose value does not fit the input's datatype."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest("'parameters' must be an object", param="parameters")
    declared = {t.name: t for t in spec.inputs}
    arrays = {}
    for key, value in body.items():
        if key in RESERVED:
            continue
        tensor = declared.get(key)
        if tensor is None:
            raise InvalidRequest(
                f"unexpected input '{key}'; model '{spec.name}' takes "
                f"{', '.join(sorted(declared))}",
                param=key,
            )
        array = _tensor(key, tensor.datatype, value)
        arrays[key] = array[None] if spec.max_batch_size > 0 else array
    return arrays, params


def _tensor(name: str, datatype: str, value: Any) -> np.ndarray[Any, Any]:
    try:
        # As objects first: a ragged nesting leaves lists among the elements.
        raw = np.asarray(value, dtype=np.object_)
        if datatype == "BYTES":
            if not all(isinstance(v, str) for v in raw.flat):
                raise ValueError("not text")
            array = np.vectorize(lambda v: v.encode("utf-8"), otypes=[np.object_])(raw)
        else:
            if not all(_of_kind(v, datatype == "BOOL") for v in raw.flat):
                raise ValueError("wrong kind")
            array = np.asarray(value, dtype=numpy_dtype(datatype))
            if datatype.startswith(("INT", "UINT")) and not np.array_equal(array, raw):
                raise ValueError("not a whole number in range")
    except (ValueError, TypeError, OverflowError):
        raise InvalidRequest(
            f"input '{name}' must be {datatype} values (a scalar or equal-length lists)",
            param=name,
        ) from None
    return array.reshape(1) if array.ndim == 0 else array


def _of_kind(value: Any, boolean: bool) -> bool:
    """Whether a JSON value is a bool (for BOOL) or a number that is not a bool."""
    if boolean:
        return isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


def generate_body(
    model_name: str,
    version: str,
    outputs: list[tuple[str, np.ndarray[Any, Any]]],
    batched: bool,
) -> dict[str, Any]:
    """One response of the generate extension: the model, then each output."""
    body: dict[str, Any] = {"model_name": model_name, "model_version": version}
    for name, array in outputs:
        if batched and array.ndim and array.shape[0] == 1:
            array = array[0]
        body[name] = _value(array)
    return body


def _value(array: np.ndarray[Any, Any]) -> Any:
    if array.dtype == np.object_:
        array = np.vectorize(_text, otypes=[np.object_])(array)
    if array.size == 1:
        item = array.reshape(-1)[0]
        return item.item() if isinstance(item, np.generic) else item
    return array.tolist()


def _text(value: Any) -> Any:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
