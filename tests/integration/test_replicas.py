"""``carpool serve --replicas 2`` on a real local Ray cluster (127.0.0.1): the same API
from two whole carpools, routed by prompt prefix, surviving a replica's death."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import SentenceTransformer

from carpool.models.registry import BUILTIN_MODELS
from tests.integration import test_embeddings_api as embeddings
from tests.integration import test_generation_api as generation
from tests.integration import test_inference_protocol as v2
from tests.integration.conftest import CHAT, MODEL, Server, start_server, stop_server

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

KILLER = 49150  # a prompt holding this token kills its replica's device runtime
SYSTEM_A = "You are a ship's navigator who answers in nautical terms. " * 12
SYSTEM_B = "You are a pastry chef who explains everything with cakes. " * 12


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(
        "--replicas",
        "2",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "256MiB",
        faults=json.dumps({"kill_runtime_on_token": KILLER}),
        timeout_s=300,
    )
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def health(server: Server) -> dict[str, Any]:
    with server.client() as c:
        response = c.get("/health")
    body: dict[str, Any] = response.json()
    assert response.status_code == (200 if body["replicas_ready"] else 503)
    return body


def per_replica(server: Server, name: str, **labels: str) -> dict[str, float]:
    """One metric's value on each replica, from the endpoint's /metrics."""
    with server.client() as c:
        text = c.get("/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            wanted = {k: v for k, v in sample.labels.items() if k != "replica"}
            if sample.name == name and wanted == labels:
                values[sample.labels["replica"]] = float(sample.value)
    return values


# The single-process suites' cases, against the replicas.


def test_models(client: openai.OpenAI) -> None:
    generation.test_models_lists_both_built_in_models(client)


def test_chat_completion(client: openai.OpenAI, server: Server) -> None:
    generation.test_chat_completion_answers_and_counts_tokens(client, server)


def test_completions_length_and_stop(client: openai.OpenAI) -> None:
    generation.test_length_finish_and_stop_strings(client)


def test_streamed_chat(client: openai.OpenAI) -> None:
    generation.test_streamed_chat_matches_the_whole_answer_and_reports_usage(client)


def test_seeded_sampling(client: openai.OpenAI) -> None:
    generation.test_seeded_sampling_repeats_and_n_gives_distinct_choices(client)


def test_bad_chat_requests_get_a_4xx(client: openai.OpenAI) -> None:
    generation.test_errors_mid_setup_use_openais_shape_for_the_client(client)


def test_embeddings_match_the_reference(client: openai.OpenAI) -> None:
    reference = SentenceTransformer(str(BUILTIN_MODELS[MODEL].locate()), device="cpu")
    embeddings.test_openai_client_gets_reference_embeddings(client, reference)


def test_embedding_errors_and_unknown_routes(client: openai.OpenAI, server: Server) -> None:
    embeddings.test_openai_client_raises_its_typed_errors(client)
    embeddings.test_unknown_route_is_a_json_404(server)
    embeddings.test_body_over_the_limit_is_refused_with_413(server)


def test_tritonclient(server: Server) -> None:
    tc = triton.InferenceServerClient(server.url.removeprefix("http://"))
    v2.test_health_and_metadata(tc)
    v2.test_infer_returns_fp32_embeddings_matching_v1(server, tc, binary=True)
    v2.test_unknown_model_is_an_error_for_the_client(tc)


# What replicas add.


def test_health_counts_ready_replicas_and_metrics_label_each(server: Server) -> None:
    body = health(server)
    assert body["replicas_ready"] == 2 and body["status"] == "ok"
    names = {r["id"] for r in body["replicas"]}
    assert len(names) == 2 and all(r["pid"] > 0 for r in body["replicas"])
    steps = per_replica(server, "carpool_engine_steps_total", model=CHAT)
    assert set(steps) == names
    with server.client() as c:
        assert "carpool_replicas 2.0" in c.get("/metrics").text


def chat(client: openai.OpenAI, system: str, question: str) -> None:
    client.chat.completions.create(
        model=CHAT,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
    )


def test_a_shared_system_prompt_lands_on_one_replica_and_another_on_the_other(
    client: openai.OpenAI, server: Server
) -> None:
    questions = [f"Question number {i}: how far is the harbour?" for i in range(5)]

    def delta(before: dict[str, float], name: str, **labels: str) -> dict[str, float]:
        after = per_replica(server, name, **labels)
        return {r: after[r] - before.get(r, 0.0) for r in after}

    before_tokens = per_replica(server, "carpool_prompt_tokens_total", model=CHAT)
    before_hits = per_replica(server, "carpool_prefix_cache_hits_total", model=CHAT)
    for q in questions:
        chat(client, SYSTEM_A, q)
    tokens_a = delta(before_tokens, "carpool_prompt_tokens_total", model=CHAT)
    hits_a = delta(before_hits, "carpool_prefix_cache_hits_total", model=CHAT)
    served_a = [r for r, n in tokens_a.items() if n > 0]
    assert len(served_a) == 1, tokens_a
    # Four of the five found the system prompt's blocks cached (16-token blocks).
    assert hits_a[served_a[0]] >= 4 * 96

    before_tokens = per_replica(server, "carpool_prompt_tokens_total", model=CHAT)
    for q in questions:
        chat(client, SYSTEM_B, q)
    tokens_b = delta(before_tokens, "carpool_prompt_tokens_total", model=CHAT)
    served_b = [r for r, n in tokens_b.items() if n > 0]
    assert len(served_b) == 1 and served_b != served_a, tokens_b


def wait_for_ready_replicas(server: Server, done: Callable[[set[int]], bool]) -> None:
    """Poll /health until ``done`` holds for the ready replicas' pids."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if done({r["pid"] for r in health(server)["replicas"] if r["ready"]}):
            return
        time.sleep(0.5)  # polling Ray's restart, bounded by the deadline
    pytest.fail(f"the replicas did not recover: {health(server)}")


def test_a_replica_whose_runtime_dies_is_replaced(server: Server, client: openai.OpenAI) -> None:
    before = {r["pid"] for r in health(server)["replicas"]}
    with server.client() as c:
        dead = c.post(
            "/v1/completions", json={"model": CHAT, "prompt": [7, KILLER], "max_tokens": 4}
        )
    assert dead.status_code == 503 and "Traceback" not in dead.text
    # The other replica goes on answering while Ray replaces the dead one.
    reply = client.completions.create(model=CHAT, prompt="Still here:", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    wait_for_ready_replicas(server, lambda pids: len(pids) == 2 and len(pids - before) == 1)


def stream_once(url: str, outcome: list[str], started: threading.Event) -> None:
    """One streamed completion; appends exactly one outcome: 'done', or the error's
    status and type."""
    body = {
        "model": CHAT,
        "prompt": "Count slowly: one, two,",
        "max_tokens": 96,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with (
            httpx.Client(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                response.read()
                started.set()
                outcome.append(f"http {response.status_code}")
                return
            tokens, error = 0, None
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = event["error"]
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                started.set()
            if error is not None:
                outcome.append(f"error {error['code']} {error['type']}")
            else:
                outcome.append("done" if tokens == 96 else f"short {tokens}")
    except httpx.HTTPError as exc:
        started.set()
        outcome.append(f"transport {type(exc).__name__}")


def test_killing_a_replica_mid_load_fails_only_its_requests_and_the_endpoint_recovers(
    server: Server, client: openai.OpenAI
) -> None:
    before = health(server)["replicas"]
    assert len(before) == 2
    outcomes: list[list[str]] = [[] for _ in range(8)]
    started = [threading.Event() for _ in range(8)]
    threads = [
        threading.Thread(target=stream_once, args=(server.url, outcomes[i], started[i]))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for s in started:
        assert s.wait(120)
    victim = before[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    # Requests sent after the death are served by the survivor (or by the replacement).
    for i in range(3):
        reply = client.completions.create(model=CHAT, prompt=f"After {i}:", max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request hung"
    assert all(len(o) == 1 for o in outcomes), outcomes
    results = [o[0] for o in outcomes]
    assert set(results) <= {"done", "error 502 server_error"}, results
    assert "error 502 server_error" in results  # the victim had streams in flight
    wait_for_ready_replicas(server, lambda pids: len(pids) == 2 and victim not in pids)
    reply = client.completions.create(model=CHAT, prompt="Recovered:", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
