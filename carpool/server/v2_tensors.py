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

from carpool.errors import InvalidRequest
from carpool.server.schemas import V2InferRequest, V2Tensor
from carpool.server.unicode_check import refuse_invalid_unicode

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
    try:
        # The standard parser, not pydantic's: it reads JSON's \ud800 escapes, so the
        # check below can say which string is not valid Unicode.
        data = json.loads(json_part)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    refuse_invalid_unicode(json_part, data)
    try:
        request = V2InferRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"invalid inference request at '{where}': {first['msg']}") from None
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


def encode_response(
    header: dict[str, Any], outputs: list[tuple[dict[str, Any], np.ndarray[Any, Any], bool]]
) -> tuple[bytes, int | None]:
    """The response body and, if any output is binary, the JSON header's length.

    ``outputs``: (output JSON without data, array, as_binary) per output.
    """
    blobs = []
    entries = []
    for meta, array, as_binary in outputs:
        entry = dict(meta)
        if as_binary:
            raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
        entries.append(entry)
    head = orjson.dumps({**header, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, None
    return head + b"".join(blobs), len(head)
