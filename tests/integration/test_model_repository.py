"""A model repository served live: Triton Python-backend models unchanged and
carpool.toml classes, through tritonclient and httpx (issue 26)."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import Server, start_server, stop_server, wait_for
from tests.integration.fuzzing import check, json_values, send
from tests.repository_models.builder import (
    DATATYPES,
    EXAMPLES,
    add_broken,
    build_finalizers,
)


@pytest.fixture(scope="module")
def repository(repository_root: Path) -> Path:
    return repository_root


@pytest.fixture(scope="module")
def server(repository_server: Server) -> Server:
    return repository_server


def client(server: Server, concurrency: int = 1) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(
        server.url.removeprefix("http://"), concurrency=concurrency, network_timeout=120
    )


def infer_x(
    c: triton.InferenceServerClient, model: str, x: np.ndarray[Any, Any]
) -> triton.InferResult:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x.astype(np.float32))
    return c.infer(model, [tensor])


def together(model: str, server: Server, arrays: list[np.ndarray[Any, Any]]) -> list[Any]:
    """Send every array at once (one thread each); the results or exceptions, in order."""

    def one(x: np.ndarray[Any, Any]) -> Any:
        try:
            return infer_x(client(server), model, x)
        except InferenceServerException as exc:
            return exc

    with ThreadPoolExecutor(len(arrays)) as pool:
        return list(pool.map(one, arrays))


def batch_sizes(server: Server, model: str) -> dict[int, int]:
    stats = client(server).get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def test_triton_example_served_unchanged(server: Server) -> None:
    c = client(server)
    assert c.is_model_ready("python_batched_service")
    config = c.get_model_config("python_batched_service")
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500000
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = triton.InferInput("input_field", [2, 3], "FP32")
    tensor.set_data_from_numpy(x)
    result = c.infer("python_batched_service", [tensor])
    np.testing.assert_array_equal(result.as_numpy("output_field"), x * 2)
    metadata = c.get_model_metadata("python_batched_service")
    assert metadata["inputs"] == [{"name": "input_field", "datatype": "FP32", "shape": [-1, -1]}]


def test_the_examples_reranker_and_pipeline(server: Server) -> None:
    with server.client() as c:
        ranked = c.post(
            "/v1/rerank", json={"model": "reranker", "query": "q", "documents": ["a", "b", "c"]}
        )
        classified = c.post("/classify", json={"model": "sentiment", "input": ["good", "bad"]})
    assert sorted(r["index"] for r in ranked.json()["results"]) == [0, 1, 2]
    data = classified.json()["data"]
    assert [d["num_classes"] for d in data] == [2, 2]
    assert {d["label"] for d in data} <= {"negative", "positive"}


def test_equal_shapes_share_a_batch_and_different_ones_do_not(server: Server) -> None:
    arrays = [np.ones((1, 3)), np.ones((1, 5)), np.ones((1, 3)), np.ones((1, 5))]
    results = together("equal_shapes", server, arrays)
    for x, result in zip(arrays, results, strict=True):
        assert result.as_numpy("count").tolist() == [[2]]  # two requests in its batch
        assert result.as_numpy("shapes").tolist() == [[1]]  # of one shape
        assert result.as_numpy("total").tolist() == [[x.sum()]]
    assert batch_sizes(server, "equal_shapes") == {2: 2}


def test_ragged_inputs_share_a_batch(server: Server) -> None:
    arrays = [np.full((1, n), n) for n in (1, 2, 3, 4)]
    results = together("ragged", server, arrays)
    for x, result in zip(arrays, results, strict=True):
        assert result.as_numpy("count").tolist() == [[4]]
        assert result.as_numpy("shapes").tolist() == [[4]]  # four shapes in one batch
        assert result.as_numpy("total").tolist() == [[x.sum()]]
    assert batch_sizes(server, "ragged") == {4: 1}


def test_a_request_batch_dimension_takes_as_many_slots(server: Server) -> None:
    arrays = [np.ones((3, 2)), np.ones((1, 2))]  # 4 slots: the preferred batch size
    results = together("ragged", server, arrays)
    assert [r.as_numpy("count").tolist() for r in results] == [[[2]] * 3, [[2]]]
    assert batch_sizes(server, "ragged")[4] == 2


@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_round_trips(server: Server, binary: bool) -> None:
    c = client(server)
    for datatype in DATATYPES:
        if datatype == "BF16" and not binary:
            continue  # tritonclient sends BF16 as binary only
        array = _sample(datatype)
        tensor = triton.InferInput(f"in_{datatype}", list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        wanted = triton.InferRequestedOutput(f"out_{datatype}", binary_data=binary)
        result = c.infer("echo", [tensor], outputs=[wanted])
        back = result.as_numpy(f"out_{datatype}")
        assert back.dtype == array.dtype, datatype
        assert back.shape == array.shape, datatype
        expected = array
        if datatype == "BYTES" and not binary:  # JSON carries strings; tritonclient keeps them
            expected = np.vectorize(bytes.decode, otypes=[np.object_])(array)
        assert back.tolist() == expected.tolist(), datatype


def _sample(datatype: str) -> np.ndarray[Any, Any]:
    if datatype == "BYTES":
        return np.array([[b"carpool", "é".encode(), b""]], dtype=np.object_)
    if datatype == "BOOL":
        return np.array([[True, False, True]])
    if datatype == "BF16":
        return np.array([[1.5, -2.0, 0.25]], dtype=ml_dtypes.bfloat16)
    dtype = np.dtype(triton.triton_to_np_dtype(datatype))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, 0, info.max]], dtype=dtype)
    return np.array([[1.5, -2.25, 1e3]], dtype=dtype)


def test_outputs_selection_returns_only_those_asked(server: Server) -> None:
    small = triton.InferInput("in_INT8", [1, 2], "INT8")
    small.set_data_from_numpy(np.array([[1, 2]], np.int8))
    wide = triton.InferInput("in_FP64", [1, 1], "FP64")
    wide.set_data_from_numpy(np.array([[0.5]]))
    result = client(server).infer(
        "echo", [small, wide], outputs=[triton.InferRequestedOutput("out_FP64")]
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["out_FP64"]
    assert result.as_numpy("out_FP64").tolist() == [[0.5]]


def test_a_failing_request_fails_alone(server: Server) -> None:
    # 13 raises in execute, -1 gets a TritonError response: only they fail, each with
    # the model's own message (its exception's class and text, as Triton says it).
    results = together("faulty", server, [np.full((1, 1), v) for v in (1, 13, -1, 2)])
    assert results[0].as_numpy("total").tolist() == [[1.0]]
    assert results[3].as_numpy("total").tolist() == [[2.0]]
    assert isinstance(results[1], InferenceServerException)
    assert results[1].status() == "500"
    assert "ValueError: 13 is unlucky" in results[1].message()
    assert "Traceback" not in results[1].message()
    assert isinstance(results[2], InferenceServerException)
    assert "negative one" in results[2].message()


def test_wrong_outputs_fail_their_request_with_a_clear_error(server: Server) -> None:
    # 7: count as FP64 where INT32 is declared; 8: one row too many.
    results = together("faulty", server, [np.full((1, 1), v) for v in (7, 8, 3, 4)])
    assert "FP64" in results[0].message() and "INT32" in results[0].message()
    assert "shape [2, 1]" in results[1].message()
    assert results[2].as_numpy("total").tolist() == [[3.0]]
    assert results[3].as_numpy("total").tolist() == [[4.0]]


def test_wrong_number_of_responses_fails_the_request(server: Server) -> None:
    with pytest.raises(InferenceServerException) as caught:
        infer_x(client(server), "miscount", np.ones((1, 1)))
    assert caught.value.status() == "500"


@pytest.mark.parametrize(
    ("tensor", "where"),
    [
        ({"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}, "x"),
        ({"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}, "x"),  # no batch dim
        ({"name": "x", "shape": [9, 1], "datatype": "FP32", "data": [1] * 9}, "x"),  # > 8
        ({"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2]}, "x"),
        ({"name": "y", "shape": [1, 1], "datatype": "FP32", "data": [1]}, "y"),
        ({"name": "x", "shape": [1, 1], "datatype": "FP32", "data": ["a"]}, "x"),
        ({"name": "x", "shape": [1, 1], "datatype": "COMPLEX", "data": [1]}, "x"),
    ],
)
def test_bad_inputs_are_400_naming_the_input(
    server: Server, tensor: dict[str, Any], where: str
) -> None:
    with server.client() as c:
        response = c.post("/v2/models/faulty/infer", json={"inputs": [tensor]})
    assert response.status_code == 400, response.text
    assert f"'{where}'" in response.json()["error"]


def test_unknown_model_version_and_output(server: Server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    with server.client() as c:
        assert c.post("/v2/models/nothing/infer", json=body).status_code == 404
        assert c.post("/v2/models/faulty/versions/2/infer", json=body).status_code == 404
        wrong = c.post("/v2/models/faulty/infer", json={**body, "outputs": [{"name": "zzz"}]})
    assert wrong.status_code == 400
    assert "'zzz'" in wrong.json()["error"]


def test_a_model_calling_sys_exit_fails_only_that_request(server: Server) -> None:
    c = client(server)
    with pytest.raises(InferenceServerException) as caught:
        infer_x(c, "hangs", np.full((1, 1), 55))
    assert caught.value.status() == "500"
    assert infer_x(c, "hangs", np.full((1, 1), 2)).as_numpy("total").tolist() == [[2.0]]
    assert c.is_server_ready()


def test_a_hung_in_process_model_fails_its_batch_and_is_replaced(server: Server) -> None:
    c = client(server)
    assert infer_x(c, "hangs", np.ones((1, 1))).as_numpy("total").tolist() == [[1.0]]
    with pytest.raises(InferenceServerException) as caught:
        infer_x(c, "hangs", np.full((1, 1), 77))  # sleeps an hour on its thread
    assert caught.value.status() == "500"
    assert "execution timeout of 1s; its instance is being replaced" in caught.value.message()
    # A new instance on a new thread serves (requests wait in the queue meanwhile).
    assert infer_x(c, "hangs", np.full((1, 1), 2)).as_numpy("total").tolist() == [[2.0]]
    assert c.is_model_ready("hangs")
    _log_until(server, "model hangs: instance 0 replaced after it hung")


def test_other_models_answer_while_one_hangs(server: Server) -> None:
    """The runtime hands a batch to the model's instance and moves on: while one
    model's batch hangs, every other model's requests are answered."""
    c = client(server)
    with ThreadPoolExecutor(1) as pool:
        ran = _queued_count(c, "crashes")
        hung = pool.submit(infer_x, client(server), "crashes", np.full((1, 1), 77))
        while _queued_count(c, "crashes") == ran:  # until its batch went to the instance
            assert not hung.done()
        answered = []
        for n in range(1, 6):
            double = c.infer("slow_double", [_x2(n)]).as_numpy("y").tolist()
            wanted = [triton.InferRequestedOutput("out_INT8")]
            echo = c.infer("echo", [_small_int(n)], outputs=wanted).as_numpy("out_INT8").tolist()
            answered.append(not hung.done())
            assert double == [[2.0 * n, 2.0 * n]] and echo == [[n]]
        assert all(answered), "another model waited for the hung one"
        with pytest.raises(InferenceServerException) as caught:
            hung.result(timeout=60)
    assert "execution timeout of 5s; its worker process is being restarted" in (
        caught.value.message()
    )
    assert infer_x(c, "crashes", np.full((1, 1), 3)).as_numpy("total").tolist() == [[3.0]]


def _queued_count(c: triton.InferenceServerClient, model: str) -> int:
    """Requests of ``model`` that have left its queue for an instance."""
    stats = c.get_inference_statistics(model)["model_stats"][0]
    return int(stats["inference_stats"]["queue"]["count"])


def _x2(n: int) -> triton.InferInput:
    tensor = triton.InferInput("x", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.full((1, 2), n, np.float32))
    return tensor


def _small_int(n: int) -> triton.InferInput:
    tensor = triton.InferInput("in_INT8", [1, 1], "INT8")
    tensor.set_data_from_numpy(np.full((1, 1), n, np.int8))
    return tensor


def test_a_model_in_its_default_process_survives_os_exit(server: Server) -> None:
    """Repository Python models run in a worker process by default (Triton's stub):
    os._exit fails the batch in flight; the worker is restarted; the server lives.
    (faulty's batches are of 4: it waits for four requests.)"""
    c = client(server)
    before = together("faulty", server, [np.full((1, 1), v) for v in (1, 2, 3, 4)])
    pids = {int(r.as_numpy("pid")[0, 0]) for r in before}
    crashed = together("faulty", server, [np.full((1, 1), v) for v in (99, 2, 3, 4)])
    for failed in crashed:
        assert isinstance(failed, InferenceServerException)
        assert failed.status() == "500" and "worker process died" in failed.message()
    after = together("faulty", server, [np.full((1, 1), v) for v in (5, 6, 10, 11)])
    assert [r.as_numpy("total").tolist() for r in after] == [
        [[5.0]],
        [[6.0]],
        [[10.0]],
        [[11.0]],
    ], [str(r) for r in after]
    assert {int(r.as_numpy("pid")[0, 0]) for r in after}.isdisjoint(pids)
    assert c.is_server_live() and c.is_model_ready("faulty")


def test_a_crashing_isolated_model_is_restarted(server: Server) -> None:
    c = client(server)
    before = int(infer_x(c, "crashes", np.ones((1, 1))).as_numpy("pid")[0, 0])
    with pytest.raises(InferenceServerException) as caught:
        infer_x(c, "crashes", np.full((1, 1), 99))  # os._exit in the model
    assert caught.value.status() == "500"
    after = int(infer_x(c, "crashes", np.ones((1, 1))).as_numpy("pid")[0, 0])
    assert after != before
    assert c.is_server_live()


def test_a_hung_isolated_model_is_restarted_and_serves_again(server: Server) -> None:
    c = client(server)
    before = int(infer_x(c, "crashes", np.ones((1, 1))).as_numpy("pid")[0, 0])
    with pytest.raises(InferenceServerException) as caught:
        infer_x(c, "crashes", np.full((1, 1), 77))  # sleeps an hour in the worker
    assert caught.value.status() == "500"
    assert "execution timeout" in caught.value.message()
    # Unready while its one worker restarts; a request meanwhile waits in the queue.
    after = infer_x(c, "crashes", np.full((1, 1), 2))
    assert after.as_numpy("total").tolist() == [[2.0]]
    assert int(after.as_numpy("pid")[0, 0]) != before
    assert c.is_model_ready("crashes")


@pytest.mark.parametrize("model", ["ready_hook", "ready_hook_async"])
def test_a_models_own_is_ready_hook_decides_its_readiness(
    server: Server, repository: Path, model: str
) -> None:
    """Triton's is_ready: asked on every readiness check, in the worker process (its
    own pipe) or on a thread, plain or async."""
    c = client(server)
    assert c.is_model_ready(model)
    flag = repository / model / "not_ready"
    flag.write_text("")
    try:
        assert not c.is_model_ready(model)
        assert c.is_server_ready()  # one model's readiness is its own
    finally:
        flag.unlink()
    assert c.is_model_ready(model)


@pytest.mark.parametrize("model", ["auto_completed", "auto_completed_bare"])
def test_a_config_completed_by_the_model(server: Server, model: str) -> None:
    """From a config.pbtxt of only its backend, or from no config file at all."""
    c = client(server)
    config = c.get_model_config(model)
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("a", "TYPE_FP32", [3]),
        ("b", "TYPE_FP32", [3]),
    ]
    a, b = triton.InferInput("a", [2, 3], "FP32"), triton.InferInput("b", [2, 3], "FP32")
    a.set_data_from_numpy(np.ones((2, 3), np.float32))
    b.set_data_from_numpy(np.full((2, 3), 2, np.float32))
    assert c.infer(model, [a, b]).as_numpy("sum").tolist() == [[3.0] * 3] * 2
    too_many = triton.InferInput("a", [5, 3], "FP32")
    too_many.set_data_from_numpy(np.ones((5, 3), np.float32))
    with pytest.raises(InferenceServerException) as refused:
        c.infer(model, [too_many, b])
    assert refused.value.status() == "400"


def bls(server: Server, model: str = "bls_caller", **params: Any) -> httpx.Response:
    body = {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}],
        "parameters": params,
    }
    with httpx.Client(base_url=server.url, timeout=60) as h:
        return h.post(f"/v2/models/{model}/infer", json=body)


@pytest.mark.parametrize("model", ["bls_caller", "bls_isolated"])
@pytest.mark.parametrize("sync", [True, False])
def test_a_model_calls_another_through_bls(server: Server, sync: bool, model: str) -> None:
    """In the server's process or in a worker process (whose calls come back over
    its pipe), exec and async_exec alike."""
    answer = bls(server, model, sync=sync)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [3.0, 5.0]  # slow_double's 2x, then + 1
    # The response parameters the model set, beside its outputs.
    assert answer.json()["parameters"] == {"called": "slow_double", "sync": sync}


@pytest.mark.parametrize("model", ["bls_caller", "bls_isolated"])
def test_response_parameters_of_another_type_fail_the_request_naming_them(
    server: Server, model: str
) -> None:
    answer = bls(server, model, bad_parameter=True)
    assert answer.status_code == 500
    assert "response parameter 'bad' to a list" in answer.json()["error"]


@pytest.mark.parametrize("model", ["bls_caller", "bls_isolated"])
@pytest.mark.parametrize("sync", [True, False])
def test_a_model_reads_a_decoupled_models_responses_through_bls(
    server: Server, sync: bool, model: str
) -> None:
    """exec(decoupled=True): every response of countdown, then the empty final one."""
    answer = bls(server, model, sync=sync, countdown=3)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [6.0, 6.0]  # 3 + 2 + 1
    assert answer.json()["parameters"] == {"remaining": "2,1,0"}  # each response's own
    failing = bls(server, model, sync=sync, countdown=-2)
    assert failing.status_code == 500 and "below zero" in failing.json()["error"]
    plain = bls(server, model, sync=sync, countdown=1, decoupled=False)
    assert plain.status_code == 500 and "exec(decoupled=True)" in plain.json()["error"]


@pytest.mark.parametrize(
    ("model", "target", "status", "message"),
    [
        ("bls_caller", "nope", 500, "no repository model 'nope'"),
        ("bls_caller", "bls_caller", 500, "cannot call itself"),
        ("bls_caller", "auto_completed", 400, "unexpected input 'x'"),
        ("bls_isolated", "nope", 500, "no repository model 'nope'"),
        ("bls_isolated", "auto_completed", 400, "unexpected input 'x'"),
    ],
)
def test_a_bls_call_that_fails_fails_its_request(
    server: Server, model: str, target: str, status: int, message: str
) -> None:
    answer = bls(server, model, target=target)
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]


def _log_until(server: Server, text: str, timeout_s: float = 60) -> None:
    """Until the server's log (read by a thread) holds ``text``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in list(server.log)):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.1)


def test_instances_run_their_batches_at_once(server: Server) -> None:
    # Each batch waits inside execute until the other instance runs one too: the two
    # requests are answered only if the model's two instances run at the same time.
    arrays = [np.full((1, 2), v, np.float32) for v in (1.0, 2.0)]
    results = together("pair", server, arrays)
    assert [r.as_numpy("y").tolist() for r in results] == [[[1.0, 1.0]], [[2.0, 2.0]]]


def stream_events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of each server-sent event of ``path``'s answer to ``body``."""
    with httpx.Client(base_url=server.url, timeout=60) as h, h.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_decoupled_model_streams_its_responses(server: Server) -> None:
    events = stream_events(server, "/v2/models/countdown/generate_stream", {"n": 3})
    assert [e["count"] for e in events] == [3, 2, 1]
    assert events[0]["model_name"] == "countdown" and events[0]["model_version"] == "1"
    failing = stream_events(server, "/v2/models/countdown/generate_stream", {"n": -2})
    assert failing == [
        {"model_name": "countdown", "model_version": "1", "count": 2},
        {"model_name": "countdown", "model_version": "1", "count": 1},
        {"error": "below zero"},
    ]
    with httpx.Client(base_url=server.url, timeout=60) as h:
        one = h.post("/v2/models/countdown/generate", json={"n": 1})
        assert one.status_code == 200 and one.json()["count"] == 1
        many = h.post("/v2/models/countdown/generate", json={"n": 2})
        assert many.status_code == 400 and "sent 2 responses" in many.json()["error"]
        v2 = {"inputs": [{"name": "n", "shape": [1], "datatype": "INT32", "data": [2]}]}
        infer = h.post("/v2/models/countdown/infer", json=v2)
        assert infer.status_code == 400 and "generate_stream" in infer.json()["error"]


def test_a_client_that_leaves_a_generate_stream_is_told_to_the_model(
    server: Server, repository_root: Path
) -> None:
    """countdown (in its worker process) sends on for 97 until told the request is
    cancelled: the HTTP client reads two events and closes its connection."""
    mark = repository_root / "countdown" / "cancelled"
    mark.unlink(missing_ok=True)
    path, body = "/v2/models/countdown/generate_stream", {"n": 97}
    with httpx.Client(base_url=server.url, timeout=60) as h, h.stream("POST", path, json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert [json.loads(next(lines)[6:])["count"] for _ in range(2)] == [97, 97]
    wait_for(mark.exists)
    assert mark.read_text() == "True"


def test_generate_serves_any_repository_model(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as h:
        answer = h.post("/v2/models/slow_double/generate", json={"x": [1, 2]})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"model_name": "slow_double", "model_version": "1", "y": [2.0, 4.0]}
        for body, field in [({"z": 1}, "z"), ({"x": ["a", "b"]}, "x"), ({"x": [1, 2, 3]}, "x")]:
            bad = h.post("/v2/models/slow_double/generate", json=body)
            assert bad.status_code == 400, bad.text
            assert f"'{field}'" in bad.json()["error"]
    events = stream_events(server, "/v2/models/slow_double/generate_stream", {"x": [1, 2]})
    assert [e["y"] for e in events] == [[2.0, 4.0]]


def test_python_class_model(server: Server) -> None:
    features = np.random.default_rng(0).random((5, 16), dtype=np.float32)
    tensor = triton.InferInput("features", [5, 16], "FP32")
    tensor.set_data_from_numpy(features)
    result = client(server).infer("mlp_classifier", [tensor])
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (5, 4)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    assert result.as_numpy("label").tolist() == probabilities.argmax(axis=1).tolist()


def test_repository_index_and_control_mode_none(server: Server) -> None:
    c = client(server)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["python_batched_service"]["state"] == "READY"
    with pytest.raises(InferenceServerException) as caught:
        c.unload_model("python_batched_service")
    assert caught.value.status() == "400"
    assert c.is_model_ready("python_batched_service")


def test_statistics_and_metrics_list_repository_models(server: Server) -> None:
    names = {s["name"] for s in client(server).get_inference_statistics()["model_stats"]}
    assert {"python_batched_service", "equal_shapes", "echo"} <= names
    assert server.metric("carpool_batches_total", model="equal_shapes") >= 2


def test_custom_metrics_of_a_model_in_its_worker_are_on_metrics(server: Server) -> None:
    """pb_utils.MetricFamily as Triton's custom_metrics example uses it, recorded in
    the model's worker process, read at scrape time with carpool's own metrics."""
    c = client(server)
    assert c.infer("metered", [_x2(1)]).as_numpy("y").tolist() == [[1.0, 1.0]]
    with httpx.Client(base_url=server.url, timeout=60) as h:
        text = h.get("/metrics").text
    # Also on the metrics port (Triton's 8002, where its custom_metrics client reads),
    # which serves nothing else.
    with httpx.Client(base_url=server.metrics_url, timeout=60) as h:
        assert 'requests_process_latency_ns{model="metered"' in h.get("/metrics").text
        assert h.get("/v2/models/metered").status_code == 404
    for pattern in (
        "# HELP requests_process_latency_ns Cumulative time spent processing requests",
        "# TYPE requests_process_latency_ns counter",
        'requests_process_latency_ns{model="metered",version="1"}',
        'batch_rows_bucket{model="metered",le="+Inf"} 1',
        "# TYPE carpool_requests_total counter",  # carpool's own beside them
    ):
        assert pattern in text, pattern
    latency = next(
        line for line in text.splitlines() if line.startswith("requests_process_latency_ns{")
    )
    assert float(latency.split()[-1]) > 0


# --- explicit model control -----------------------------------------------------------


@pytest.fixture(scope="module")
def explicit(repository: Path) -> Iterator[Server]:
    add_broken(repository)
    s = start_server(
        "--model-repository",
        str(repository),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "slow_double",
    )
    yield s
    assert stop_server(s) == 0


def test_load_and_unload_at_runtime(explicit: Server) -> None:
    c = client(explicit)
    index = {m["name"]: m["state"] for m in c.get_model_repository_index()}
    assert index["slow_double"] == "READY"
    assert index["echo"] == "UNAVAILABLE"
    assert not c.is_model_ready("echo") if _exists(c, "echo") else True
    c.load_model("echo")
    tensor = triton.InferInput("in_INT8", [1, 2], "INT8")
    tensor.set_data_from_numpy(np.array([[1, -1]], np.int8))
    out = c.infer("echo", [tensor], outputs=[triton.InferRequestedOutput("out_INT8")])
    assert out.as_numpy("out_INT8").tolist() == [[1, -1]]
    c.unload_model("echo")
    with pytest.raises(InferenceServerException) as gone:
        c.infer("echo", [tensor])
    assert gone.value.status() == "404"


def _exists(c: triton.InferenceServerClient, name: str) -> bool:
    try:
        c.get_model_metadata(name)
    except InferenceServerException:
        return False
    return True


def test_a_failed_load_leaves_the_rest_serving(explicit: Server) -> None:
    c = client(explicit)
    with pytest.raises(InferenceServerException) as caught:
        c.load_model("broken")
    assert caught.value.status() == "400"
    assert "this_module_does_not_exist" in caught.value.message()
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert "this_module_does_not_exist" in index["broken"]["reason"]
    x = np.ones((1, 2), np.float32)
    tensor = triton.InferInput("x", [1, 2], "FP32")
    tensor.set_data_from_numpy(x)
    assert c.infer("slow_double", [tensor]).as_numpy("y").tolist() == [[2.0, 2.0]]


def test_unload_under_load_loses_nothing(explicit: Server) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    statuses: list[int] = []
    lock = threading.Lock()
    started = threading.Barrier(9)

    def hammer() -> None:
        with httpx.Client(base_url=explicit.url, timeout=60) as h:
            started.wait()
            while True:
                response = h.post("/v2/models/slow_double/infer", json=body)
                with lock:
                    statuses.append(response.status_code)
                if response.status_code == 200:
                    assert response.json()["outputs"][0]["data"] == [2.0, 4.0]
                    continue
                assert response.status_code in (503, 404), response.text
                if response.status_code == 503:
                    assert "retry-after" in response.headers
                return

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait()
    c = client(explicit)
    while True:  # let some requests through before unloading
        with lock:
            if statuses.count(200) >= 16:
                break
    c.unload_model("slow_double")
    for t in threads:
        t.join()
    assert len(statuses) >= 16
    assert set(statuses) <= {200, 503, 404}
    assert statuses.count(200) >= 16
    c.load_model("slow_double")
    x = np.ones((1, 2), np.float32)
    tensor = triton.InferInput("x", [1, 2], "FP32")
    tensor.set_data_from_numpy(x)
    assert c.infer("slow_double", [tensor]).as_numpy("y").tolist() == [[2.0, 2.0]]


# --- poll mode -------------------------------------------------------------------------


def _index_until(server: Server, done: Any, timeout_s: float = 60) -> dict[str, Any]:
    """The repository index once ``done(index)`` holds (the server polls the folder)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        index = {m["name"]: m for m in client(server).get_model_repository_index()}
        if done(index):
            return index
        assert time.monotonic() < deadline, index
        time.sleep(0.2)


def test_poll_mode_follows_the_folder(tmp_path: Path) -> None:
    shutil.copytree(EXAMPLES / "python_batched_service", tmp_path / "python_batched_service")
    s = start_server(
        "--model-repository", str(tmp_path), "--model-control-mode", "poll",
        "--repository-poll-secs", "0.5",
    )  # fmt: skip
    try:
        c = client(s)
        with pytest.raises(InferenceServerException):
            c.load_model("python_batched_service")  # poll mode: no explicit control
        shutil.copytree(EXAMPLES / "mlp_classifier", tmp_path / "mlp_classifier")
        _index_until(s, lambda i: i.get("mlp_classifier", {}).get("state") == "READY")
        assert c.is_model_ready("mlp_classifier")
        shutil.rmtree(tmp_path / "python_batched_service")
        _index_until(s, lambda i: "python_batched_service" not in i)
        with pytest.raises(InferenceServerException) as gone:
            c.get_model_metadata("python_batched_service")
        assert gone.value.status() == "404"
    finally:
        assert stop_server(s) == 0


def test_shutdown_releases_every_model_after_the_drain(tmp_path: Path) -> None:
    """SIGTERM: the requests drain (gRPC's too), then each model's finalize / teardown
    runs (in its worker process or its thread), and the server exits 0."""
    repository = build_finalizers(tmp_path)
    s = start_server("--model-repository", str(repository), "--grpc-port", "-1")
    x = np.ones((1, 2), np.float32)
    try:
        for name in ("finalizer", "teardown"):
            tensor = triton.InferInput("x", [1, 2], "FP32")
            tensor.set_data_from_numpy(x)
            assert client(s).infer(name, [tensor]).as_numpy("y").tolist() == x.tolist()
        assert not (repository / "finalizer" / "finalized").exists()
        # A gRPC call in flight when the drain begins is answered; one after is refused.
        grpc_client = tgrpc.InferenceServerClient(s.grpc_url)
        gate = tgrpc.InferInput("x", [1, 2], "FP32")
        gate.set_data_from_numpy(x)
        answered: queue.Queue[Any] = queue.Queue()
        grpc_client.async_infer(
            "gate", [gate], callback=lambda result, error: answered.put((result, error))
        )
        wait_for(lambda: (repository / "gate" / "started").exists())
        s.process.send_signal(signal.SIGTERM)
        wait_for(lambda: any("gRPC: no new calls taken" in line for line in s.log))
        with pytest.raises(InferenceServerException) as refused:
            grpc_client.infer("gate", [gate])
        (repository / "gate" / "release").write_text("go")
        result, error = answered.get(timeout=60)
        assert error is None and result.as_numpy("y").tolist() == x.tolist()
    finally:
        code = stop_server(s)
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert code == 0
    assert (repository / "finalizer" / "finalized").read_text() == "finalized"
    assert (repository / "teardown" / "torn_down").read_text() == "torn down"


REPOSITORY_VALID: dict[str, dict[str, Any]] = {
    "/v2/models/slow_double/infer": {
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]
    },
    "/v2/models/auto_completed/infer": {
        "inputs": [
            {"name": "a", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
            {"name": "b", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]},
        ],
        "outputs": [{"name": "sum"}],
    },
    "/v2/models/slow_double/generate": {"x": [1, 2]},
    "/v2/repository/index": {"ready": True},
    "/v2/repository/models/slow_double/load": {"parameters": {}},
    "/v2/repository/models/slow_double/unload": {"parameters": {}},
}


@pytest.mark.parametrize("path", sorted(REPOSITORY_VALID))
def test_any_field_of_a_repository_request_gets_a_clear_answer(server: Server, path: str) -> None:
    """Any value in any field of the body, or of its first tensor: never a 500."""
    body = REPOSITORY_VALID[path]
    tensor = body.get("inputs", [{}])[0]
    fields = sorted({*body, *(f"inputs.{k}" for k in tensor), "unknown", "inputs.parameters"})
    sent = {"count": 0}

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(fields), value=json_values)
    def one(field: str, value: object) -> None:
        changed = json.loads(json.dumps(body))
        if field.startswith("inputs.") and "inputs" in changed:
            changed["inputs"][0][field.removeprefix("inputs.")] = value
        else:
            changed[field.removeprefix("inputs.")] = value
        check(send(h, path, changed))
        sent["count"] += 1

    with httpx.Client(base_url=server.url, timeout=60) as h:  # making one takes ~0.05 s
        one()
    assert sent["count"] >= 20
    c = client(server)
    assert c.infer("slow_double", [_x2(3)]).as_numpy("y").tolist() == [[6.0, 6.0]]
    assert c.is_model_ready("slow_double")


def test_many_names_and_repeated_names_are_answered_at_once(server: Server) -> None:
    """25,000 distinct input names (1.7 MB) are judged in linear time (counting each
    name's repeats held the event loop 10 s at 30,000); a repeated input or output name
    is a 400 (Triton refuses both; a repeated output would copy the answer per mention)."""
    one = {"shape": [1, 2], "datatype": "FP32", "data": [1, 2]}
    many = {"inputs": [{"name": f"x{i}", **one} for i in range(25_000)]}
    twice = {"inputs": [{"name": "x", **one}, {"name": "x", **one}]}
    echoed = {"inputs": [{"name": "x", **one}], "outputs": [{"name": "y"}] * 2000}
    with httpx.Client(base_url=server.url, timeout=120) as h:
        answers = [h.post("/v2/models/slow_double/infer", json=b) for b in (many, twice, echoed)]
        assert h.get("/v2/health/ready").status_code == 200
    assert [a.status_code for a in answers] == [400, 400, 400]
    assert "unexpected input 'x0'" in answers[0].json()["error"]
    assert "input 'x' is given twice" in answers[1].json()["error"]
    assert "output 'y' is given twice" in answers[2].json()["error"]
