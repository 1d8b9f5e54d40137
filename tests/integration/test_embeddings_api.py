"""/v1/embeddings and /v1/models with the official openai client and httpx."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import SentenceTransformer

from carpool.models.registry import BUILTIN_MODELS
from tests.integration.conftest import MODEL, Server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(BUILTIN_MODELS[MODEL].locate()), device="cpu")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_models_lists_the_embedding_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_client_gets_reference_embeddings(
    client: openai.OpenAI, reference: SentenceTransformer
) -> None:
    texts = [
        "carpool shares the ride",
        "a second, longer sentence about batching requests together",
    ]
    result = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in result.data] == [0, 1]
    expected = reference.encode(texts)
    for item, ref in zip(result.data, expected, strict=True):
        assert len(item.embedding) == 384
        assert cosine(np.array(item.embedding), ref) >= 0.9999
    assert result.usage.prompt_tokens == sum(
        len(reference.tokenizer(t)["input_ids"]) for t in texts
    )


def test_float_and_base64_encodings_agree(server: Server) -> None:
    body = {"model": MODEL, "input": "same text"}
    with server.client() as c:
        floats = c.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
        b64 = c.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"][
            0
        ]["embedding"]
    assert np.array_equal(
        np.frombuffer(base64.b64decode(b64), dtype="<f4"), np.array(floats, dtype=np.float32)
    )


def test_token_id_inputs_equal_text_inputs(server: Server, reference: SentenceTransformer) -> None:
    ids = reference.tokenizer("token ids in")["input_ids"]
    with server.client() as c:
        from_text = c.post("/v1/embeddings", json={"model": MODEL, "input": "token ids in"}).json()
        from_ids = c.post("/v1/embeddings", json={"model": MODEL, "input": ids}).json()
        from_lists = c.post("/v1/embeddings", json={"model": MODEL, "input": [ids, ids]}).json()
    assert from_ids["data"][0]["embedding"] == from_text["data"][0]["embedding"]
    assert len(from_lists["data"]) == 2 and from_lists["usage"]["prompt_tokens"] == 2 * len(ids)


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"model": "no-such-model", "input": "x"}, 404, "no-such-model"),
        ({"model": MODEL, "input": ""}, 400, "empty"),
        ({"model": MODEL, "input": []}, 400, "empty"),
        ({"model": MODEL, "input": ["ok", ""]}, 400, "input[1]"),
        ({"model": MODEL, "input": 5}, 400, "input"),
        ({"model": MODEL, "input": [1.5]}, 400, "input"),
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": 128}, 400, "dimensions"),
        ({"model": MODEL, "input": [10**7]}, 400, "vocabulary"),
        ({"model": MODEL, "input": "word " * 400}, 400, "maximum of 256"),
        ({"model": MODEL, "input": "x", "priority": 9}, 400, "priority"),
    ],
)
def test_bad_input_gets_a_4xx_naming_the_problem(
    server: Server, body: dict[str, object], status: int, names: str
) -> None:
    with server.client() as c:
        response = c.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert names in error["message"] or names == error["param"]
    assert "Traceback" not in response.text


def test_malformed_json_is_a_400(server: Server) -> None:
    with server.client() as c:
        response = c.post(
            "/v1/embeddings", content=b'{"model": ', headers={"content-type": "application/json"}
        )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_truncation_on_request_embeds_long_text(server: Server) -> None:
    with server.client() as c:
        response = c.post(
            "/v1/embeddings", json={"model": MODEL, "input": "word " * 400, "truncate": True}
        )
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == 256


def test_body_over_the_limit_is_refused_with_413(server: Server) -> None:
    huge = b'{"model": "x", "input": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    with server.client() as c:
        response = c.post(
            "/v1/embeddings", content=huge, headers={"content-type": "application/json"}
        )
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]


def test_openai_client_raises_its_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="missing", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")


def test_health_and_metrics_are_served(server: Server) -> None:
    with server.client() as c:
        assert c.get("/health").status_code == 200
        text = c.get("/metrics").text
    for name in (
        "carpool_requests_total",
        "carpool_queue_duration_seconds_bucket",
        "carpool_compute_duration_seconds_bucket",
        "carpool_batch_size_bucket",
        "carpool_pending_requests",
    ):
        assert f"{name}{{" in text, name
    assert server.metric("carpool_requests_total", model=MODEL, outcome="success") > 0


def test_unknown_route_is_a_json_404(server: Server) -> None:
    with httpx.Client(base_url=server.url) as c:
        response = c.get("/v1/nothing-here")
    assert response.status_code == 404 and "error" in response.json()
