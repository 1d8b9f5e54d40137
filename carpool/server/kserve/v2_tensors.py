"""Decoding and encoding tensors of the Open Inference Protocol, including Triton's
binary tensor data extension (a JSON header followed by raw tensor bytes)."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from carpool.errors import InvalidRequest, ModelExecutionError
from carpool.repository.datatypes import DATATYPES, datatype_of, numpy_dtype
from carpool.server.generation.schemas import V2InferRequest, V2Tensor
from carpool.server.http.unicode_check import may_hold_surrogates, refuse_invalid_unicode

HEADER_LENGTH = "inference-header-content-length"


def parse_request(
    body: bytes, header_length: str | None
) -> tuple[V2InferRequest, dict[str, bytes]]:
    """The JSON request and, per input name, its binary data (binary extension)."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidRequest(f"bad Inference-Header-Content-Length {header_length!r}")
        split = int(header_length)
        json_part, binary = body[:split], body[split:]
    request = validated_request(_parse_json(json_part))
    blobs: dict[str, bytes] = {}
    offset = 0
    for tensor in request.inputs:
        size = (tensor.parameters or {}).get("binary_data_size")
        if size is None:
            continue
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidRequest(f"input '{tensor.name}': binary_data_size does not match the body")
        blobs[tensor.name] = binary[offset : offset + size]
        offset += size
    if offset != len(binary):
        raise InvalidRequest("request body has binary data that no input claims")
    return request, blobs


def validated_request(data: Any) -> V2InferRequest:
    """``data`` as the inference request; ``InvalidRequest`` naming where it is wrong."""
    try:
        return V2InferRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"invalid inference request at '{where}': {first['msg']}") from None


def _parse_json(text: bytes) -> Any:
    """The body's JSON: orjson (several times faster on numbers) when the body holds no
    escaped surrogate; else the standard parser, which reads JSON's \\ud800 escapes so
    that the check can say which string is not valid Unicode."""
    if not may_hold_surrogates(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # the standard parser's message says where
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    refuse_invalid_unicode(text, data)
    return data


def decode_bytes_tensor(tensor: V2Tensor, blob: bytes | None) -> list[str]:
    """The strings of a BYTES tensor, from JSON data or binary data."""
    if tensor.datatype != "BYTES":
        raise InvalidRequest(f"input '{tensor.name}' must be BYTES, got {tensor.datatype}")
    count = math.prod(tensor.shape) if tensor.shape else 0
    if blob is not None:
        items = _unpack_bytes(blob, tensor.name)
    elif tensor.data is not None:
        items = _flatten(tensor.data)
    else:
        raise InvalidRequest(f"input '{tensor.name}' has neither data nor binary_data_size")
    if len(items) != count:
        raise InvalidRequest(
            f"input '{tensor.name}' has {len(items)} elements "
            f"but shape {tensor.shape} needs {count}"
        )
    texts = []
    for item in items:
        if isinstance(item, bytes):
            try:
                texts.append(item.decode("utf-8"))
            except UnicodeDecodeError:
                raise InvalidRequest(
                    f"input '{tensor.name}' holds bytes that are not UTF-8"
                ) from None
        elif isinstance(item, str):
            texts.append(item)
        else:
            raise InvalidRequest(
                f"input '{tensor.name}' must hold strings, found {type(item).__name__}"
            )
    return texts


def _flatten(data: list[Any]) -> list[Any]:
    """The leaves of nested lists, in order (iterative: any nesting depth)."""
    if list not in map(type, data):  # flat already, as tritonclient sends it
        return data
    leaves: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            leaves.append(item)
        else:
            stack.pop()
    return leaves


def _unpack_bytes(blob: bytes, name: str) -> list[bytes]:
    items = []
    offset = 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            raise InvalidRequest(f"input '{name}': truncated BYTES element length")
        (length,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if offset + length > len(blob):
            raise InvalidRequest(f"input '{name}': BYTES element overruns the data")
        items.append(blob[offset : offset + length])
        offset += length
    return items


def decode_tensor(tensor: V2Tensor, blob: bytes | None) -> np.ndarray[Any, Any]:
    """Any datatype's tensor as the numpy array a model sees (BYTES: an object array of
    ``bytes``), from JSON data or binary data. Raises ``InvalidRequest`` naming it."""
    name = tensor.name
    if tensor.datatype not in DATATYPES:
        raise InvalidRequest(
            f"input '{name}' has datatype {tensor.datatype!r}; one of {', '.join(DATATYPES)} "
            "is expected",
            param=name,
        )
    shape = tuple(tensor.shape)
    count = math.prod(shape)
    if tensor.datatype == "BYTES":
        items = _unpack_bytes(blob, name) if blob is not None else _json_items(tensor)[0]
        _check_count(name, len(items), shape, count)
        return np.array([_as_bytes(v, name) for v in items] or [], dtype=np.object_).reshape(shape)
    dtype = numpy_dtype(tensor.datatype)
    if blob is not None:
        if len(blob) != count * dtype.itemsize:
            raise InvalidRequest(
                f"input '{name}' has {len(blob)} bytes of data but shape {list(shape)} of "
                f"{tensor.datatype} needs {count * dtype.itemsize}",
                param=name,
            )
        if tensor.datatype == "BOOL" and bool((np.frombuffer(blob, np.uint8) > 1).any()):
            raise InvalidRequest(f"input '{name}' holds BOOL bytes other than 0 and 1", param=name)
        return np.frombuffer(blob, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
    items, kinds = _json_items(tensor)
    _check_count(name, len(items), shape, count)
    return _json_array(items, kinds, tensor.datatype, dtype, name).reshape(shape)


def _json_items(tensor: V2Tensor) -> tuple[list[Any], set[type]]:
    """The JSON data's leaves and the set of their Python types (one pass over flat
    data, as tritonclient sends it: the hot path of a small request)."""
    if tensor.data is None:
        raise InvalidRequest(
            f"input '{tensor.name}' has neither data nor binary_data_size", param=tensor.name
        )
    items = tensor.data
    kinds = set(map(type, items))
    if list in kinds:
        items = _flatten(items)
        kinds = set(map(type, items))
    return items, kinds


def _check_count(name: str, found: int, shape: tuple[int, ...], count: int) -> None:
    if found != count:
        raise InvalidRequest(
            f"input '{name}' has {found} elements but shape {list(shape)} needs {count}",
            param=name,
        )


def _as_bytes(item: Any, name: str) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    raise InvalidRequest(
        f"input '{name}' must hold strings, found {type(item).__name__}", param=name
    )


def _json_array(
    items: list[Any], kinds: set[type], datatype: str, dtype: np.dtype[Any], name: str
) -> np.ndarray[Any, Any]:
    """``items`` (JSON leaves whose Python types are ``kinds``) as ``datatype``."""
    if datatype == "BOOL":
        if not kinds <= {bool}:
            raise InvalidRequest(f"input '{name}' must hold true or false", param=name)
        return np.array(items, dtype=np.bool_)
    # numpy reads the list in C and its dtype says what the elements were; JSON's
    # true and false (which numpy would take as 1 and 0) are looked for separately.
    try:
        parsed = np.array(items) if items else np.zeros(0, dtype)
    except (ValueError, OverflowError):
        parsed = np.array(items, dtype=np.object_)
    has_bool = bool in kinds
    if dtype.kind in "iu":
        if has_bool:
            raise InvalidRequest(f"input '{name}' must hold integers", param=name)
        if parsed.dtype.kind not in "iu":
            # Integers numpy could not hold in one type (0 beside 2**64 - 1 is read as
            # float64): read them again as the tensor's own type.
            if not kinds <= {int}:
                raise InvalidRequest(f"input '{name}' must hold integers", param=name)
            try:
                return np.array(items, dtype=dtype)
            except OverflowError:
                raise InvalidRequest(_out_of_range(name, datatype, dtype), param=name) from None
        info = np.iinfo(dtype)
        if parsed.size and not (info.min <= parsed.min() and parsed.max() <= info.max):
            raise InvalidRequest(_out_of_range(name, datatype, dtype), param=name)
        return parsed.astype(dtype)
    if has_bool or parsed.dtype.kind not in "iuf":
        raise InvalidRequest(f"input '{name}' must hold numbers", param=name)
    with np.errstate(over="ignore"):
        return parsed.astype(dtype)


def _out_of_range(name: str, datatype: str, dtype: np.dtype[Any]) -> str:
    info = np.iinfo(dtype)
    return f"input '{name}' holds a value outside {datatype}'s range {info.min}..{info.max}"


def pack_bytes(array: np.ndarray[Any, Any]) -> bytes:
    """A BYTES tensor in the binary extension's form: each element's 4-byte
    little-endian length, then its bytes."""
    parts = []
    for item in array.reshape(-1):
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def output_entry(
    name: str, array: np.ndarray[Any, Any], as_binary: bool
) -> tuple[dict[str, Any], bytes | None]:
    """One output's JSON entry and, if binary, its bytes (any datatype)."""
    datatype = datatype_of(array) or "BYTES"
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if as_binary:
        if datatype == "BYTES":
            raw = pack_bytes(array)
        else:
            raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        entry["parameters"] = {"binary_data_size": len(raw)}
        return entry, raw
    flat = array.reshape(-1)
    if datatype == "BYTES":
        try:
            entry["data"] = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
        except UnicodeDecodeError:
            raise ModelExecutionError(
                f"output '{name}' holds bytes that are not UTF-8; ask for it as binary data"
            ) from None
    elif datatype == "BF16":
        entry["data"] = flat.astype(np.float32)
    else:
        entry["data"] = np.ascontiguousarray(flat)
    return entry, None


def encode_outputs(
    header: dict[str, Any], outputs: list[tuple[str, np.ndarray[Any, Any], bool]]
) -> tuple[bytes, int | None]:
    """The response body for named outputs of any datatype and, if any is binary, the
    JSON header's length."""
    entries = []
    blobs = []
    for name, array, as_binary in outputs:
        entry, raw = output_entry(name, array, as_binary)
        entries.append(entry)
        if raw is not None:
            blobs.append(raw)
    head = orjson.dumps({**header, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
