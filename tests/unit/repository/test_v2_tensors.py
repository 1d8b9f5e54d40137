"""Decoding request tensors of every datatype, and what is refused."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from carpool.errors import InvalidRequest
from carpool.server.generation.schemas import V2Tensor
from carpool.server.kserve.v2_tensors import decode_tensor, output_entry, pack_bytes


def tensor(datatype: str, shape: list[int], data: list | None = None, **params: int) -> V2Tensor:
    return V2Tensor(name="t", shape=shape, datatype=datatype, data=data, parameters=params or None)


def test_binary_data_of_each_width() -> None:
    raw = np.array([1.5, -2], np.float16).tobytes()
    np.testing.assert_array_equal(
        decode_tensor(tensor("FP16", [2]), raw), np.array([1.5, -2], np.float16)
    )
    bf = np.array([[1.5, 2]], ml_dtypes.bfloat16)
    assert decode_tensor(tensor("BF16", [1, 2]), bf.tobytes()).tolist() == bf.tolist()
    big = np.array([2**63 - 1], np.int64)
    assert decode_tensor(tensor("INT64", [1]), big.tobytes()).tolist() == [2**63 - 1]


def test_bytes_both_ways() -> None:
    blob = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0)
    assert decode_tensor(tensor("BYTES", [2]), blob).tolist() == [b"hi", b""]
    assert decode_tensor(tensor("BYTES", [1, 1], [["é"]]), None).tolist() == [["é".encode()]]
    assert pack_bytes(np.array([b"hi", b""], np.object_)) == blob


@pytest.mark.parametrize(
    ("t", "blob", "message"),
    [
        (tensor("INT8", [1], [128]), None, "range"),
        (tensor("UINT8", [1], [-1]), None, "range"),
        (tensor("INT32", [1], [1.5]), None, "integers"),
        (tensor("BOOL", [1], [1]), None, "true or false"),
        (tensor("BOOL", [2, 1], [[True], [1]]), None, "true or false"),
        (tensor("FP32", [2], [1.5, True]), None, "numbers"),
        (tensor("FP32", [2, 1], [[1.5], [False]]), None, "numbers"),
        (tensor("INT32", [2], [1, True]), None, "integers"),
        (tensor("UINT64", [2], [True, 2**64 - 1]), None, "integers"),
        (tensor("FP32", [1], ["1"]), None, "numbers"),
        (tensor("FP32", [2], [1.0]), None, "elements"),
        (tensor("FP32", [2]), b"\0" * 4, "bytes of data"),
        (tensor("BOOL", [1]), b"\x02", "BOOL"),
        (tensor("BYTES", [1], [3]), None, "strings"),
        (tensor("FP8", [1], [1]), None, "datatype"),
        (tensor("FP32", [1]), None, "neither"),
    ],
)
def test_refused(t: V2Tensor, blob: bytes | None, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as caught:
        decode_tensor(t, blob)
    assert caught.value.param == "t"


def test_json_data_flat_or_nested() -> None:
    flat = decode_tensor(tensor("FP32", [2, 2], [1, 2.5, 3, 4]), None)
    nested = decode_tensor(tensor("FP32", [2, 2], [[1, 2.5], [3, 4]]), None)
    assert flat.dtype == nested.dtype == np.float32
    assert flat.tolist() == nested.tolist() == [[1.0, 2.5], [3.0, 4.0]]
    assert decode_tensor(tensor("BOOL", [1, 2], [[True, False]]), None).tolist() == [[True, False]]


def test_outputs_as_json_and_binary() -> None:
    entry, raw = output_entry("y", np.array([[1, 2]], np.uint16), as_binary=True)
    assert entry == {"name": "y", "datatype": "UINT16", "shape": [1, 2],
                     "parameters": {"binary_data_size": 4}}  # fmt: skip
    assert raw == np.array([1, 2], "<u2").tobytes()
    entry, raw = output_entry("y", np.array([b"a"], np.object_), as_binary=False)
    assert raw is None and entry["data"] == ["a"]
    entry, _ = output_entry("y", np.array([1.5], ml_dtypes.bfloat16), as_binary=False)
    assert entry["datatype"] == "BF16" and entry["data"].tolist() == [1.5]


def test_json_integers_at_the_edges_of_their_type() -> None:
    top = 2**64 - 1
    assert decode_tensor(tensor("UINT64", [3], [0, 0, top]), None).tolist() == [0, 0, top]
    low, high = -(2**63), 2**63 - 1
    assert decode_tensor(tensor("INT64", [2], [low, high]), None).tolist() == [low, high]
    with pytest.raises(InvalidRequest, match="range"):
        decode_tensor(tensor("INT64", [2], [0, 2**63]), None)
    with pytest.raises(InvalidRequest, match="range"):
        decode_tensor(tensor("UINT64", [2], [-1, top]), None)
    with pytest.raises(InvalidRequest, match="integers"):
        decode_tensor(tensor("UINT64", [2], [0.5, top]), None)
