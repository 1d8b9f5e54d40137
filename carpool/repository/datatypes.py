"""The tensor datatypes of the Open Inference Protocol and Triton's model config.

One table: the protocol's name (``FP32``), the config's name (``TYPE_FP32``) and the
numpy dtype a model sees (tritonclient's mapping: BYTES is an object array of
``bytes``, BF16 is ``ml_dtypes.bfloat16``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "BF16",
    "FP32",
    "FP64",
    "BYTES",
)
# Triton's config names its string type TYPE_STRING; every other is TYPE_ + the name.
_CONFIG_NAMES = {("TYPE_STRING" if d == "BYTES" else "TYPE_" + d): d for d in DATATYPES}


def from_config_name(name: str) -> str:
    """The protocol datatype of a config ``data_type`` (``TYPE_FP32`` -> ``FP32``);
    ``ValueError`` for one carpool does not carry."""
    if name not in _CONFIG_NAMES:
        raise ValueError(f"data type {name!r} is not supported; supported: {sorted(_CONFIG_NAMES)}")
    return _CONFIG_NAMES[name]


def config_name(datatype: str) -> str:
    """The config name of a protocol datatype (``FP32`` -> ``TYPE_FP32``)."""
    return "TYPE_STRING" if datatype == "BYTES" else "TYPE_" + datatype


@functools.lru_cache(maxsize=64)  # a lookup on every request; names are few
def numpy_dtype(datatype: str) -> np.dtype[Any]:
    """The numpy dtype a model sees for ``datatype``."""
    return np.dtype(triton_to_np_dtype(datatype))


def datatype_of(array: np.ndarray[Any, Any]) -> str | None:
    """The protocol datatype of ``array``; None for a dtype the protocol has no name
    for. Unicode string arrays count as BYTES."""
    return _datatype_of_dtype(array.dtype)


@functools.lru_cache(maxsize=256)  # checked on every output; tritonclient's chain of
def _datatype_of_dtype(dtype: np.dtype[Any]) -> str | None:  # comparisons is slow
    if dtype.kind == "U":
        return "BYTES"
    name = np_to_triton_dtype(dtype)
    return name if name in DATATYPES else None


def with_bytes(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array``, its unicode strings (if it holds those) as UTF-8 ``bytes`` in an
    object array: how a model sees and returns BYTES."""
    if array.dtype.kind != "U":
        return array
    return np.vectorize(lambda s: s.encode("utf-8"), otypes=[np.object_])(array)
