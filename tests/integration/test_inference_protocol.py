"""The Open Inference Protocol (/v2) with the official tritonclient."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.conftest import MODEL, Server


@pytest.fixture(scope="module")
def client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def text_input(texts: list[str], binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(
        np.array([t.encode() for t in texts], dtype=object), binary_data=binary
    )
    return tensor


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    assert meta["parameters"]["execution"] == ["encoder attention: native (ragged_attention)"]
    assert client.get_server_metadata()["name"] == "carpool"
    assert client.get_model_config(MODEL)["max_batch_size"] == 128


@pytest.mark.parametrize("binary", [False, True])
def test_infer_returns_fp32_embeddings_matching_v1(
    server: Server, client: triton.InferenceServerClient, binary: bool
) -> None:
    texts = ["the first sentence", "and a second one"]
    result = client.infer(
        MODEL,
        [text_input(texts, binary)],
        outputs=[triton.InferRequestedOutput("embedding", binary_data=binary)],
    )
    embeddings = result.as_numpy("embedding")
    assert embeddings.shape == (2, 384) and embeddings.dtype == np.float32
    with server.client() as c:
        v1 = c.post("/v1/embeddings", json={"model": MODEL, "input": texts}).json()["data"]
    assert np.allclose(embeddings, np.array([d["embedding"] for d in v1]), atol=1e-6)


def test_statistics_follow_tritons_shape(client: triton.InferenceServerClient) -> None:
    client.infer(MODEL, [text_input(["count me"], binary=False)])
    stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert stats["name"] == MODEL and stats["inference_count"] >= 1
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(stats["inference_stats"][key]) == {"count", "ns"}
    assert stats["inference_stats"]["success"]["count"] >= 1
    assert (
        sum(b["compute_infer"]["count"] * b["batch_size"] for b in stats["batch_stats"])
        == stats["inference_count"]
    )


def test_unknown_model_is_an_error_for_the_client(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="not served"):
        client.infer("missing", [text_input(["x"], binary=False)])


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (
            {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["one"]}]},
            "shape",
        ),
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}, "BYTES"),
        ({"inputs": [{"name": "other", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}, "text"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [""]}]}, "empty"),
        ({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [7]}]}, "strings"),
        (
            {
                "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
                "outputs": [{"name": "logits"}],
            },
            "logits",
        ),
    ],
)
def test_bad_infer_requests_get_a_400_in_the_protocols_shape(
    server: Server, body: dict[str, object], names: str
) -> None:
    with server.client() as c:
        response = c.post(f"/v2/models/{MODEL}/infer", json=body)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and names in response.json()["error"]


def test_v2_errors_for_malformed_json_and_unknown_models(server: Server) -> None:
    with httpx.Client(base_url=server.url) as c:
        malformed = c.post(f"/v2/models/{MODEL}/infer", content=b"{nope")
        missing = c.get("/v2/models/missing")
        missing_infer = c.post("/v2/models/missing/versions/1/infer", json={"inputs": []})
        wrong_method = c.get(f"/v2/models/{MODEL}/infer")
    assert malformed.status_code == 400 and "error" in malformed.json()
    assert missing.status_code == 404 and "missing" in missing.json()["error"]
    assert missing_infer.status_code == 404 and "missing" in missing_infer.json()["error"]
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error"}
