"""Pipelines, a reranker and an embedder from a model repository, served live and
compared with the same libraries' in-process answers (issue 26)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from PIL import Image
from sentence_transformers import CrossEncoder, SentenceTransformer
from transformers import pipeline

from tests.integration.conftest import Server, start_server, stop_server, wait_for
from tests.integration.fuzzing import check, json_values, send
from tests.repository_models.library import build_library_models, png

QUERY = "what is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "France is in Europe."]
TEXTS = ["a good day", "a bad, bad day", "nothing much happened today at all"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("library-repository")


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory, repository: Path) -> dict[str, Path]:
    return build_library_models(repository, tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def server(repository: Path, weights: dict[str, Path]) -> Iterator[Server]:
    s = start_server("--model-repository", str(repository))
    yield s
    assert stop_server(s) == 0
    # At the default log level the libraries' own progress bars (one per batch) would
    # have reached the log; uvicorn's last line says the log is whole.
    wait_for(lambda: any("Finished server process" in line for line in s.log))
    assert not [line for line in s.log if "Batches" in line]


def concurrently(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def test_rerank_and_score_match_the_cross_encoder(server: Server, weights: dict[str, Path]) -> None:
    expected = CrossEncoder(str(weights["reranker"])).predict([(QUERY, d) for d in DOCUMENTS])
    with server.client() as c:
        bodies = concurrently(
            [
                lambda: c.post("/v1/rerank", json={"model": "reranker", "query": QUERY,
                                                   "documents": DOCUMENTS, "top_n": 2}).json(),
                lambda: c.post("/rerank", json={"model": "reranker", "query": QUERY,
                                                "documents": [{"text": d} for d in DOCUMENTS],
                                                "return_documents": False}).json(),
                lambda: c.post("/v1/score", json={"model": "reranker", "text_1": QUERY,
                                                  "text_2": DOCUMENTS}).json(),
            ]
        )  # fmt: skip
    top, everything, scores = bodies
    order = list(np.argsort(-expected, kind="stable"))
    assert [r["index"] for r in top["results"]] == order[:2]
    assert top["results"][0]["document"]["text"] == DOCUMENTS[order[0]]
    assert [r["index"] for r in everything["results"]] == order
    assert "document" not in everything["results"][0]
    np.testing.assert_allclose([d["score"] for d in scores["data"]], expected, atol=1e-5)
    got = {r["index"]: r["relevance_score"] for r in everything["results"]}
    np.testing.assert_allclose([got[i] for i in range(3)], expected, atol=1e-5)


def test_classify_and_predict_match_the_pipeline(server: Server, weights: dict[str, Path]) -> None:
    local = pipeline("text-classification", model=str(weights["sentiment"]))
    expected = [{a["label"]: a["score"] for a in local(t, top_k=None)} for t in TEXTS]
    with server.client() as c:
        classified = c.post("/classify", json={"model": "sentiment", "input": TEXTS}).json()
        predicted = c.post("/predict", json={"inputs": TEXTS[0]}).json()
    for want, got in zip(expected, classified["data"], strict=True):
        np.testing.assert_allclose(
            got["probs"], [want[k] for k in ("negative", "neutral", "positive")], atol=1e-5
        )
        assert got["label"] == max(want, key=want.__getitem__)
    assert [p["label"] for p in predicted] == sorted(expected[0], key=lambda k: -expected[0][k])


def test_embeddings_match_sentence_transformers(server: Server, weights: dict[str, Path]) -> None:
    expected = SentenceTransformer(str(weights["embedder"])).encode(TEXTS)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    got = client.embeddings.create(model="embedder", input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in got.data], expected, atol=1e-5)


def _infer_json(server: Server, model: str, inputs: dict[str, list[Any]]) -> list[Any]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    tensors = []
    for name, rows in inputs.items():
        array = np.array(rows, dtype=np.object_)
        tensor = triton.InferInput(name, list(array.shape), "BYTES")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = c.infer(model, tensors).as_numpy("result")
    return [json.loads(r) for r in result.reshape(-1)]


@pytest.mark.parametrize(
    ("model", "task"),
    [
        ("entities", "token-classification"),
        ("masks", "fill-mask"),
        ("features", "feature-extraction"),
    ],
)
def test_json_pipelines_match(
    server: Server, weights: dict[str, Path], model: str, task: str
) -> None:
    texts = [t.replace("day", "[MASK]") for t in TEXTS] if task == "fill-mask" else TEXTS
    local = pipeline(task, model=str(weights[model]))
    got = _infer_json(server, model, {"text": [[t] for t in texts]})
    for text, answer in zip(texts, got, strict=True):
        want = json.loads(json.dumps(local(text), default=float))
        _close(answer, want)


def _close(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want)
        for key in want:
            _close(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _close(a, b)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    else:
        assert got == want


def test_zero_shot_and_images_match(server: Server, weights: dict[str, Path]) -> None:
    labels = ["travel", "food", "sport"]
    local = pipeline("zero-shot-classification", model=str(weights["zero_shot"]))
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    text = triton.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[TEXTS[0]]], np.object_))
    candidates = triton.InferInput("candidate_labels", [1, 3], "BYTES")
    candidates.set_data_from_numpy(np.array([labels], np.object_))
    result = c.infer("zero_shot", [text, candidates])
    want = local(TEXTS[0], candidate_labels=labels)
    assert [x.decode() for x in result.as_numpy("labels")[0]] == want["labels"]
    np.testing.assert_allclose(result.as_numpy("scores")[0], want["scores"], atol=1e-5)

    images = pipeline("image-classification", model=str(weights["images"]))
    blobs = [png(1), png(2)]
    image = triton.InferInput("image", [2, 1], "BYTES")
    image.set_data_from_numpy(np.array([[b] for b in blobs], np.object_))
    result = c.infer("images", [image])
    for row, blob in enumerate(blobs):
        answer = images(Image.open(BytesIO(blob)).convert("RGB"), top_k=None)
        want = {a["label"]: a["score"] for a in answer}
        assert result.as_numpy("label")[row, 0].decode() == max(want, key=want.__getitem__)
        np.testing.assert_allclose(
            result.as_numpy("scores")[row],
            [want[k] for k in ("negative", "neutral", "positive")],
            atol=1e-5,
        )


def test_task_endpoints_refuse_the_wrong_model_and_bad_bodies(server: Server) -> None:
    with server.client() as c:
        wrong = c.post("/v1/rerank", json={"model": "sentiment", "query": "q", "documents": ["d"]})
        empty = c.post("/v1/rerank", json={"model": "reranker", "query": "q", "documents": []})
        uneven = c.post("/v1/score", json={"model": "reranker", "text_1": ["a", "b"],
                                           "text_2": ["c", "d", "e"]})  # fmt: skip
        missing = c.post("/classify", json={"model": "nothing", "input": "x"})
        top = c.post("/v1/rerank", json={"model": "reranker", "query": "q", "documents": ["d"],
                                         "top_n": 0})  # fmt: skip
    assert wrong.status_code == 400 and "rerank" in wrong.text
    assert empty.status_code == 400 and "documents" in empty.text
    assert uneven.status_code == 400 and "text_2" in uneven.text
    assert missing.status_code == 404
    assert top.status_code == 400 and "top_n" in top.text


def test_a_text_over_a_pipelines_limit_is_a_400_or_truncated_when_asked(server: Server) -> None:
    long = "word " * 300  # over the tiny models' 128 positions
    tensor = {"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [long]}
    with server.client() as c:
        classify = c.post("/classify", json={"model": "sentiment", "input": ["short", long]})
        predict = c.post("/predict", json={"inputs": long, "model": "sentiment"})
        truncated = c.post(
            "/predict", json={"inputs": long, "model": "sentiment", "truncate": True}
        )
        features = c.post("/v2/models/features/infer", json={"inputs": [tensor]})
        cut = c.post(
            "/v2/models/features/infer",
            json={"parameters": {"truncate": True}, "inputs": [tensor]},
        )
    for refused in (classify, predict, features):
        assert refused.status_code == 400, refused.text
        assert "128" in refused.text and "truncate" in refused.text
    assert truncated.status_code == 200 and len(truncated.json()) == 3
    assert cut.status_code == 200
    vectors = json.loads(cut.json()["outputs"][0]["data"][0])
    assert len(vectors[0]) == 128  # one vector per kept token


TASK_VALID: dict[str, dict[str, Any]] = {
    "/v1/rerank": {"model": "reranker", "query": "q", "documents": ["a", "b"]},
    "/v1/score": {"model": "reranker", "text_1": "a", "text_2": ["b", "c"]},
    "/classify": {"model": "sentiment", "input": ["a", "b"]},
    "/predict": {"model": "sentiment", "inputs": "a"},
}


@pytest.mark.parametrize("path", sorted(TASK_VALID))
def test_any_field_of_a_task_request_gets_a_clear_answer(server: Server, path: str) -> None:
    # Not "timeout": a tiny one rightly expires in the queue (504, which check() counts
    # as the server's failure).
    fields = sorted({*TASK_VALID[path], "unknown", "truncate", "priority", "top_n"})
    sent = {"count": 0}

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(field=st.sampled_from(fields), value=json_values)
    def one(field: str, value: object) -> None:
        check(send(client, path, {**TASK_VALID[path], field: value}))
        sent["count"] += 1

    with server.client() as client:  # one for the campaign: making one takes ~0.05 s
        one()
    assert sent["count"] >= 15
    with server.client() as c:
        again = c.post(path, json=TASK_VALID[path])
    assert again.status_code == 200, again.text
