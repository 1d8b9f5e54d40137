"""The gRPC messages become what the HTTP route parses, and outputs become raw contents."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2

from carpool.errors import InvalidRequest
from carpool.server.kserve.v2_grpc_messages import infer_request, infer_response, parameters
from carpool.server.kserve.v2_models import Answer
from carpool.server.kserve.v2_tensors import decode_tensor


def test_raw_contents_become_the_binary_extensions_blobs() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m", id="7")
    msg.inputs.add(name="a", datatype="INT32", shape=[2])
    msg.raw_input_contents.append(np.array([1, -2], "<i4").tobytes())
    msg.parameters["priority"].uint64_param = 2
    msg.parameters["timeout"].int64_param = 500
    msg.outputs.add(name="y")
    body, blobs = infer_request(msg)
    assert body.id == "7" and body.parameters == {"priority": 2, "timeout": 500}
    assert [o.name for o in body.outputs or []] == ["y"]
    assert decode_tensor(body.inputs[0], blobs["a"]).tolist() == [1, -2]


def test_typed_contents_are_read_from_the_datatypes_field() -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    floats = msg.inputs.add(name="f", datatype="FP64", shape=[1, 2])
    floats.contents.fp64_contents.extend([0.5, -1.0])
    flags = msg.inputs.add(name="b", datatype="BOOL", shape=[1])
    flags.contents.bool_contents.append(True)
    body, blobs = infer_request(msg)
    assert blobs == {}
    assert decode_tensor(body.inputs[0], None).tolist() == [[0.5, -1.0]]
    assert decode_tensor(body.inputs[1], None).tolist() == [True]


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda m: m.raw_input_contents.append(b"\0" * 4), "raw_input_contents for 2 inputs"),
        (lambda m: None, "'h' of FP16 must be sent as raw_input_contents"),
    ],
)
def test_contents_that_cannot_be_read_are_named(build: object, words: str) -> None:
    msg = service_pb2.ModelInferRequest(model_name="m")
    msg.inputs.add(name="i", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    msg.inputs.add(name="h", datatype="FP16", shape=[1])
    build(msg)  # type: ignore[operator]
    with pytest.raises(InvalidRequest, match=words):
        infer_request(msg)


def test_parameters_of_every_kind() -> None:
    msg = service_pb2.ModelInferRequest()
    msg.parameters["b"].bool_param = True
    msg.parameters["s"].string_param = "x"
    msg.parameters["d"].double_param = 0.25
    assert parameters(msg.parameters) == {"b": True, "s": "x", "d": 0.25}


def test_outputs_travel_as_raw_contents_tritonclient_reads() -> None:
    texts = np.array([b"a", "é".encode()], dtype=np.object_)
    numbers = np.arange(6, dtype=np.float16).reshape(2, 3)
    response = infer_response("m", "1", "r", Answer([("t", texts), ("n", numbers)]), final=False)
    result = InferResult(response)
    assert result.as_numpy("t").tolist() == texts.tolist()
    np.testing.assert_array_equal(result.as_numpy("n"), numbers)
    assert [o.datatype for o in response.outputs] == ["BYTES", "FP16"]
    assert response.parameters["triton_final_response"].bool_param is False
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "r")


def test_response_parameters_travel_in_the_field_of_their_type() -> None:
    said = {"flag": True, "count": 3, "share": 0.5, "note": "x"}
    response = infer_response("m", "1", "r", Answer([], said))
    p = response.parameters
    assert (p["flag"].bool_param, p["count"].int64_param) == (True, 3)
    assert (p["share"].double_param, p["note"].string_param) == (0.5, "x")
    assert p["flag"].WhichOneof("parameter_choice") == "bool_param"  # not an int
    assert "triton_final_response" not in p
