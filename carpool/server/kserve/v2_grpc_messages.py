"""The KServe v2 gRPC protocol's messages (the generated ones ``tritonclient`` ships)
to and from what the /v2 HTTP routes already speak: an inference request becomes the
same ``V2InferRequest`` and binary blobs that the HTTP binary extension gives, so
both protocols run through the same model adapters (``v2_models``). Pure functions."""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2

from carpool.errors import InvalidRequest
from carpool.server.generation.schemas import V2InferRequest
from carpool.server.kserve.v2_models import Answer
from carpool.server.kserve.v2_tensors import output_entry, validated_request

M = TypeVar("M", bound=Message)

# The typed field of ``InferTensorContents`` that holds each datatype (FP16 and BF16
# have none: they travel as raw contents only, as in Triton).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# Set by the client (tritonclient's ``enable_empty_final_response``) and on each
# streamed response, as Triton's gRPC frontend does.
EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def parameters(params: Any) -> dict[str, Any]:
    """A protobuf map of ``InferParameter`` (or ``ModelRepositoryParameter``) as plain
    Python values."""
    values = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        values[key] = getattr(param, choice) if choice else None
    return values


def infer_request(msg: service_pb2.ModelInferRequest) -> tuple[V2InferRequest, dict[str, bytes]]:
    """The request as the HTTP route would have parsed it, and per input its raw
    contents. Raises ``InvalidRequest`` naming what is wrong."""
    raw = list(msg.raw_input_contents)
    if raw and len(raw) != len(msg.inputs):
        raise InvalidRequest(
            f"the request has {len(raw)} raw_input_contents for {len(msg.inputs)} inputs; "
            "send raw contents for every input or for none"
        )
    inputs = []
    blobs: dict[str, bytes] = {}
    for i, tensor in enumerate(msg.inputs):
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if raw:
            blobs[tensor.name] = raw[i]
            entry["parameters"] = {"binary_data_size": len(raw[i])}
        elif tensor.datatype in CONTENTS_FIELD:
            entry["data"] = list(getattr(tensor.contents, CONTENTS_FIELD[tensor.datatype]))
        else:
            raise InvalidRequest(
                f"input '{tensor.name}' of {tensor.datatype} must be sent as raw_input_contents",
                param=tensor.name,
            )
        inputs.append(entry)
    body: dict[str, Any] = {"inputs": inputs}
    if msg.id:
        body["id"] = msg.id
    if msg.parameters:
        body["parameters"] = parameters(msg.parameters)
    if msg.outputs:
        body["outputs"] = [{"name": o.name} for o in msg.outputs]
    return validated_request(body), blobs


def infer_response(
    model: str,
    version: str,
    request_id: str,
    answer: Answer,
    final: bool | None = None,
) -> service_pb2.ModelInferResponse:
    """The answer's outputs as raw contents (Triton's gRPC frontend answers so) and its
    parameters; ``final`` sets ``triton_final_response`` where the answer is one of a
    stream."""
    response = service_pb2.ModelInferResponse(
        model_name=model, model_version=version, id=request_id
    )
    for name, array in answer.outputs:
        entry, raw = output_entry(name, array, as_binary=True)
        response.outputs.add(name=name, datatype=entry["datatype"], shape=entry["shape"])
        response.raw_output_contents.append(raw or b"")
    for key, value in answer.parameters.items():
        _set_parameter(response.parameters[key], value)
    if final is not None:
        response.parameters[FINAL].bool_param = final
    return response


def _set_parameter(parameter: Any, value: str | int | float | bool) -> None:
    """An ``InferParameter`` holding ``value`` in its field for the type (a bool before
    an int: Python's bools are ints)."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = value


def from_dict(data: dict[str, Any], message: M) -> M:
    """``data`` (the JSON the HTTP route answers) as the protocol's message; fields
    the message does not have are left out."""
    return json_format.ParseDict(data, message, ignore_unknown_fields=True)
