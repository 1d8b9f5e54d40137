"""The KServe v2 gRPC service with Triton's own clients, ``tritonclient.grpc`` and
``tritonclient.grpc.aio``, unchanged: health, metadata, config, inference of every
datatype, a decoupled model's stream, statistics, the repository extension and
errors as Triton's gRPC status codes (issue 50)."""

from __future__ import annotations

import asyncio
import json
import queue
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import Server, wait_for
from tests.integration.test_model_repository import _sample
from tests.repository_models.builder import DATATYPES
from tests.repository_models.tensor_models import MLP_SIZES, mlp_numpy, mlp_weights


@pytest.fixture(scope="module")
def server(repository_server: Server) -> Server:
    return repository_server


def client(server: Server) -> tgrpc.InferenceServerClient:
    return tgrpc.InferenceServerClient(server.grpc_url)


def _input(name: str, array: np.ndarray[Any, Any], datatype: str) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def batches_of(server: Server, model: str) -> Counter[int]:
    """How many batches of each size ``model`` has run."""
    stats = client(server).get_inference_statistics(model, as_json=True)["model_stats"][0]
    return Counter(
        {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    )


def test_health_metadata_config_and_inference(server: Server) -> None:
    c = client(server)
    assert c.is_server_live() and c.is_server_ready()
    assert c.get_server_metadata(as_json=True)["name"] == "carpool"
    assert c.is_model_ready("python_batched_service")
    metadata = c.get_model_metadata("python_batched_service", as_json=True)
    assert metadata["inputs"] == [
        {"name": "input_field", "datatype": "FP32", "shape": ["-1", "-1"]}
    ]
    config = c.get_model_config("python_batched_service", as_json=True)["config"]
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "500000"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = c.infer("python_batched_service", [_input("input_field", x, "FP32")], request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("output_field"), x * 2)
    assert result.get_response().id == "r1"


def test_every_datatype_round_trips(server: Server) -> None:
    c = client(server)
    for datatype in DATATYPES:
        array = _sample(datatype)
        wanted = tgrpc.InferRequestedOutput(f"out_{datatype}")
        result = c.infer("echo", [_input(f"in_{datatype}", array, datatype)], outputs=[wanted])
        back = result.as_numpy(f"out_{datatype}")
        assert back.dtype == array.dtype and back.shape == array.shape, datatype
        assert back.tolist() == array.tolist(), datatype
        assert [o.name for o in result.get_response().outputs] == [f"out_{datatype}"]


def test_typed_tensor_contents_are_read_as_raw_ones_are(server: Server) -> None:
    """Clients other than tritonclient send ``contents`` instead of raw bytes."""
    request = service_pb2.ModelInferRequest(model_name="echo")
    ints = request.inputs.add(name="in_INT16", datatype="INT16", shape=[1, 3])
    ints.contents.int_contents.extend([-5, 0, 7])
    texts = request.inputs.add(name="in_BYTES", datatype="BYTES", shape=[1, 2])
    texts.contents.bytes_contents.extend([b"a", b"bc"])
    request.outputs.add(name="out_INT16")
    request.outputs.add(name="out_BYTES")
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request)
        result = tgrpc.InferResult(response)
        assert result.as_numpy("out_INT16").tolist() == [[-5, 0, 7]]
        assert result.as_numpy("out_BYTES").tolist() == [[b"a", b"bc"]]
        ints.contents.int_contents.append(40000)  # out of INT16's range, and one too many
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "in_INT16" in caught.value.details()


@pytest.mark.parametrize(
    ("model", "tensor", "status", "text"),
    [
        ("nope", ("x", "FP32"), "StatusCode.NOT_FOUND", "nope"),
        ("slow_double", ("x", "INT8"), "StatusCode.INVALID_ARGUMENT", "'x'"),
        ("slow_double", ("z", "FP32"), "StatusCode.INVALID_ARGUMENT", "'z'"),
        ("hangs", ("x", "FP32"), "StatusCode.INTERNAL", "ValueError: 13 is unlucky"),
    ],
)
def test_errors_carry_tritons_status_codes(
    server: Server, model: str, tensor: tuple[str, str], status: str, text: str
) -> None:
    name, datatype = tensor
    x = np.full((1, 2), 13, dtype=tgrpc.triton_to_np_dtype(datatype))
    with pytest.raises(InferenceServerException) as caught:
        client(server).infer(model, [_input(name, x, datatype)])
    assert caught.value.status() == status
    assert text in caught.value.message()


def test_a_decoupled_models_responses_stream(server: Server) -> None:
    c = client(server)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for n, rid in ((3, "three"), (-1, "minus")):
            c.async_stream_infer(
                "countdown",
                [_input("n", np.array([n], np.int32), "INT32")],
                request_id=rid,
                enable_empty_final_response=True,
            )
        x = np.ones((1, 2), np.float32)
        c.async_stream_infer("slow_double", [_input("x", x, "FP32")], request_id="double")
        answers: dict[str, list[Any]] = {}
        errors = []
        while len(errors) < 1 or sum(map(len, answers.values())) < 6:
            result, error = got.get(timeout=60)
            if error is not None:
                errors.append(error.message())
                continue
            response = result.get_response()
            answers.setdefault(response.id, []).append(result)
    finally:
        c.stop_stream()
    counts = [r.as_numpy("count") for r in answers["three"]]
    assert [int(a[0]) for a in counts if a is not None] == [3, 2, 1]
    finals = [
        r.get_response().parameters["triton_final_response"].bool_param for r in answers["three"]
    ]
    assert finals == [False, False, False, True]  # the empty final response comes last
    said = [r.get_response().parameters for r in answers["three"][:3]]
    assert [p["remaining"].int64_param for p in said] == [2, 1, 0]
    assert [p["last"].bool_param for p in said] == [False, False, True]
    assert said[0]["share"].double_param == pytest.approx(1 / 3)
    assert [int(r.as_numpy("count")[0]) for r in answers["minus"]] == [1]
    assert errors == ["below zero"]
    np.testing.assert_array_equal(answers["double"][0].as_numpy("y"), x * 2)


def test_a_decoupled_model_whose_process_ends_fails_its_open_streams_alone(
    server: Server,
) -> None:
    """countdown runs in a worker process (the repository's default isolation): its
    responses cross a pipe. 99 sends one response and leaves its stream open; 98 ends
    the process. Both requests fail, each saying why; the next is answered by the
    worker that replaced it."""
    c = client(server)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer("countdown", [_input("n", np.array([99], np.int32), "INT32")])
        first, error = got.get(timeout=60)
        assert error is None and int(first.as_numpy("count")[0]) == 99
        c.async_stream_infer("countdown", [_input("n", np.array([98], np.int32), "INT32")])
        errors = sorted(error.message() for _, error in (got.get(timeout=60) for _ in range(2)))
    finally:
        c.stop_stream()
    assert "worker process died" in errors[0]
    assert "worker process ended before the request's final response" in errors[1]
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:  # waits for the replaced worker
        c.async_stream_infer("countdown", [_input("n", np.array([2], np.int32), "INT32")])
        answers = [got.get(timeout=120) for _ in range(2)]
    finally:
        c.stop_stream()
    assert [error for _, error in answers] == [None, None]
    assert [int(result.as_numpy("count")[0]) for result, _ in answers] == [2, 1]


def test_a_client_that_cancels_its_stream_is_told_to_the_model_in_its_worker_process(
    server: Server, repository_root: Path
) -> None:
    """countdown runs in a worker process; 97 sends until its sender reports the request
    cancelled, then leaves a mark. The client reads two responses and cancels: the
    worker's model is told (else it would send on for a minute and mark "False")."""
    mark = repository_root / "countdown" / "cancelled"
    mark.unlink(missing_ok=True)
    c = client(server)
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer("countdown", [_input("n", np.array([97], np.int32), "INT32")])
        for _ in range(2):
            result, error = got.get(timeout=60)
            assert error is None and int(result.as_numpy("count")[0]) == 97
    finally:
        c.stop_stream(cancel_requests=True)
    wait_for(mark.exists)
    assert mark.read_text() == "True"


def test_the_asyncio_client_infers_and_streams(server: Server) -> None:
    async def run() -> tuple[Any, list[int]]:
        async with tgrpc_aio.InferenceServerClient(server.grpc_url) as c:
            x = np.ones((1, 2), np.float32)
            one = await c.infer("slow_double", [_input("x", x, "FP32")])

            async def requests() -> Any:
                yield {
                    "model_name": "countdown",
                    "inputs": [_input("n", np.array([2], np.int32), "INT32")],
                }

            counts = []
            async for result, error in c.stream_infer(requests()):
                assert error is None
                counts.append(int(result.as_numpy("count")[0]))
            return one.as_numpy("y"), counts

    y, counts = asyncio.run(run())
    assert y.tolist() == [[2.0, 2.0]] and counts == [2, 1]


def test_statistics_and_repository_index(server: Server) -> None:
    c = client(server)
    c.infer("slow_double", [_input("x", np.ones((1, 2), np.float32), "FP32")])
    stats = c.get_inference_statistics("slow_double", as_json=True)["model_stats"]
    assert stats[0]["name"] == "slow_double" and int(stats[0]["inference_count"]) >= 1
    every = c.get_inference_statistics(as_json=True)["model_stats"]
    assert {"slow_double", "echo", "countdown"} <= {s["name"] for s in every}
    index = {m["name"]: m for m in c.get_model_repository_index(as_json=True)["models"]}
    assert index["slow_double"]["state"] == "READY"
    with pytest.raises(InferenceServerException) as caught:
        c.unload_model("slow_double")  # model control mode none, as Triton's default
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert c.is_model_ready("slow_double")


@pytest.mark.parametrize(
    ("model", "inputs", "expected"),
    [
        (
            "onnx_mlp",
            lambda i: {"x": np.full((1, MLP_SIZES[0]), i, np.float32)},
            lambda a: {"y": mlp_numpy(a["x"], mlp_weights(MLP_SIZES))},
        ),
        (
            "scale_sum",
            lambda i: {
                "INPUT__0": np.full((1, 3), i, np.float32),
                "INPUT__1": np.ones((1, 3), np.float32),
            },
            lambda a: {
                "OUTPUT__0": a["INPUT__0"] * 2,
                "OUTPUT__1": (a["INPUT__0"] + 1).sum(1, keepdims=True),
            },
        ),
    ],
)
def test_onnx_and_torchscript_models_batch_requests_of_both_protocols(
    server: Server, model: str, inputs: Any, expected: Any
) -> None:
    """Four requests, two over HTTP and two over gRPC, run as one batch of four (the
    model's preferred size) and each gets its own rows back."""

    def over_grpc(arrays: dict[str, Any]) -> Any:
        return client(server).infer(model, [_input(n, a, "FP32") for n, a in arrays.items()])

    def over_http(arrays: dict[str, Any]) -> Any:
        c = thttp.InferenceServerClient(server.url.removeprefix("http://"))
        tensors = []
        for name, array in arrays.items():
            tensor = thttp.InferInput(name, list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return c.infer(model, tensors)

    requests = [inputs(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: (over_grpc, over_http)[i % 2](requests[i]), range(4)))
    for arrays, result in zip(requests, results, strict=True):
        for name, want in expected(arrays).items():
            np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-5, atol=1e-6)
    stats = client(server).get_inference_statistics(model, as_json=True)["model_stats"][0]
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        ("4", "1")
    ]
    platform = client(server).get_model_metadata(model).platform
    assert platform == {"onnx_mlp": "onnxruntime_onnx", "scale_sum": "pytorch_libtorch"}[model]


def test_an_ensemble_runs_its_steps_each_batched_by_its_own_model(server: Server) -> None:
    """Four requests to a Python-then-TorchScript ensemble: the TorchScript step runs
    them as one batch (its preferred size, four); each gets its own answer."""
    before = batches_of(server, "scale_sum")
    vs = [np.array([[i, 1.0, 2.0]], np.float32) for i in range(4)]

    def one(v: np.ndarray[Any, Any]) -> Any:
        return client(server).infer("echo_then_scale", [_input("v", v, "FP32")])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, vs))
    for v, result in zip(vs, results, strict=True):
        np.testing.assert_array_equal(result.as_numpy("doubled"), v * 2)
        np.testing.assert_array_equal(result.as_numpy("total"), (v * 2).sum(1, keepdims=True))
    assert batches_of(server, "scale_sum") - before == Counter({4: 1})
    assert batches_of(server, "echo_then_scale")  # the ensemble's own statistics
    c = client(server)
    assert c.get_model_metadata("echo_then_scale").platform == "ensemble"
    assert c.is_model_ready("echo_then_scale")
    index = {m.name: m.state for m in c.get_model_repository_index().models}
    assert index["echo_then_scale"] == "READY"


def test_a_failing_step_fails_the_request_with_its_message(server: Server) -> None:
    c = client(server)
    ok = c.infer("failing_step", [_input("v", np.array([[1.0, 2.0]], np.float32), "FP32")])
    assert ok.as_numpy("sum").tolist() == [[3.0]]
    with pytest.raises(InferenceServerException) as caught:
        c.infer("failing_step", [_input("v", np.array([[13.0]], np.float32), "FP32")])
    assert caught.value.status() == "StatusCode.INTERNAL"
    assert "ensemble 'failing_step' step 'hangs'" in caught.value.message()
    assert "ValueError: 13 is unlucky" in caught.value.message()
    with httpx.Client(base_url=server.url, timeout=60) as h:
        body = {"inputs": [{"name": "v", "shape": [1, 1], "datatype": "FP32", "data": [13]}]}
        over_http = h.post("/v2/models/failing_step/infer", json=body)
    assert over_http.status_code == 500 and "13 is unlucky" in over_http.json()["error"]


def _llm_request(prompt: str, request_id: str, stream: bool, sampling: dict[str, str]) -> Any:
    """A request as Triton's vLLM sample client builds it: the prompt, the stream flag
    and the sampling parameters as a JSON tensor (numbers as text) and as parameters."""
    text = tgrpc_aio.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = tgrpc_aio.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream]))
    params = tgrpc_aio.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    return {
        "model_name": "llm",
        "inputs": [text, flag, params],
        "outputs": [tgrpc_aio.InferRequestedOutput("text_output")],
        "request_id": request_id,
        "parameters": sampling,
    }


def test_an_llm_folder_streams_over_grpc_as_tritons_vllm_client_reads_it(server: Server) -> None:
    """A vLLM-backend folder (config.pbtxt + 1/model.json) served by carpool's engine:
    the sample client's stream gives each step's text, which joins to what
    /v1/completions answers the same model."""
    prompts = {"0": "The sky is", "1": "Hello, my name is"}
    sampling = {"temperature": "0", "max_tokens": "6", "ignore_eos": "true"}

    async def run() -> dict[str, list[str]]:
        async with tgrpc_aio.InferenceServerClient(server.grpc_url) as c:

            async def requests() -> Any:
                for rid, prompt in prompts.items():
                    yield _llm_request(prompt, rid, True, sampling)

            pieces: dict[str, list[str]] = {}
            async for result, error in c.stream_infer(inputs_iterator=requests()):
                assert error is None, error
                text = result.as_numpy("text_output")[0].decode()
                pieces.setdefault(result.get_response().id, []).append(text)
            return pieces

    pieces = asyncio.run(run())
    with httpx.Client(base_url=server.url, timeout=60) as h:
        for rid, prompt in prompts.items():
            body = {"model": "llm", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            completion = h.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert len(pieces[rid]) == 6 and "".join(pieces[rid]) == completion
    index = {m.name: m.state for m in client(server).get_model_repository_index().models}
    assert index["llm"] == "READY"
    assert client(server).get_model_config("llm").config.model_transaction_policy.decoupled


def test_an_llm_answers_the_generate_extension(server: Server) -> None:
    """Triton's documented curl calls: the whole text after the prompt by default,
    without it when asked, and the extra outputs asked for."""
    params = {"stream": False, "temperature": 0, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as h:
        whole = h.post(
            "/v2/models/llm/generate", json={"text_input": "One, two,", "parameters": params}
        )
        bare = h.post(
            "/v2/models/llm/generate",
            json={
                "text_input": "One, two,",
                "exclude_input_in_output": True,
                "return_finish_reason": True,
                "return_num_output_tokens": True,
                "parameters": params,
            },
        )
        wrong = h.post(
            "/v2/models/llm/generate",
            json={"text_input": "x", "parameters": {"temperature": "hot"}},
        )
    assert whole.status_code == 200 and bare.status_code == 200, (whole.text, bare.text)
    assert whole.json()["text_output"] == "One, two," + bare.json()["text_output"]
    assert bare.json()["finish_reason"] == "length" and bare.json()["num_output_tokens"] == 4
    assert wrong.status_code == 400 and "temperature" in wrong.json()["error"]
