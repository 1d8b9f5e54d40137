"""With an API key, every model endpoint refuses a missing or wrong key; the key
check compares fixed-length digests in constant time; over-large bodies are
refused without being read whole; prompts and outputs stay out of the logs."""

from __future__ import annotations

import hmac
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from carpool.server.http import auth
from tests.integration.conftest import Server, start_server, stop_server

CHAT = "smollm2-135m-instruct"
KEY = "correct-horse-battery-staple"
MARKER = "zanzibar-quokka-7781"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server(
        "--api-key", KEY, "--max-body-bytes", "65536", "--kv-cache-memory", "64MiB",
        "--grpc-port", "-1",
    )  # fmt: skip
    yield s
    assert stop_server(s) == 0


def model_endpoints(server: Server) -> list[tuple[str, str]]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        spec = c.get("/openapi.json").json()
    found = []
    for path, methods in spec["paths"].items():
        concrete = path.replace("{model_name}", "all-minilm-l6-v2").replace(
            "{name}", "all-minilm-l6-v2"
        )
        for method in methods:
            if auth.needs_key(concrete):
                found.append((method.upper(), concrete))
    return found


def test_every_model_endpoint_refuses_a_missing_or_wrong_key(server: Server) -> None:
    endpoints = model_endpoints(server)
    assert ("POST", "/v1/chat/completions") in endpoints and len(endpoints) >= 12
    wrong_keys = [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"x-api-key": "nope"},
        {"x-api-key": f"Bearer {KEY}"},
    ]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path in endpoints:
            for headers in wrong_keys:
                r = c.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers)
        for path in ("/health", "/metrics", "/v2/health/live", "/v2/health/ready", "/v2"):
            assert c.get(path).status_code == 200, path
        ok = c.post(
            "/tokenize",
            json={"model": CHAT, "prompt": "x"},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert ok.status_code == 200
        anthropic_ok = c.post(
            "/v1/messages/count_tokens",
            json={"model": CHAT, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": KEY},
        )
        assert anthropic_ok.status_code == 200 and anthropic_ok.json()["input_tokens"] > 0


def test_the_anthropic_sdk_sends_its_key_as_x_api_key(server: Server) -> None:
    ask: list[Any] = [{"role": "user", "content": "hi"}]
    right = anthropic.Anthropic(base_url=server.url, api_key=KEY)
    assert right.messages.create(model=CHAT, max_tokens=2, messages=ask).usage.output_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope")
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=CHAT, max_tokens=2, messages=ask)
    assert caught.value.body == {  # Anthropic's error shape on its route
        "type": "error",
        "error": {"type": "authentication_error", "message": caught.value.body["error"]["message"]},  # type: ignore[index]
    }


def test_grpc_takes_the_key_as_metadata_and_limits_message_size(server: Server) -> None:
    """Over gRPC as over HTTP: health and server metadata open, every model call
    UNAUTHENTICATED without the key, a message over the body limit refused."""
    c = tgrpc.InferenceServerClient(server.grpc_url)
    assert c.is_server_live() and c.get_server_metadata().name == "carpool"
    texts = np.array([b"hello", b"world"], dtype=np.object_)
    tensor = tgrpc.InferInput("text", [2], "BYTES")
    tensor.set_data_from_numpy(texts)
    calls = [
        lambda headers: c.infer("all-minilm-l6-v2", [tensor], headers=headers),
        lambda headers: c.get_model_metadata("all-minilm-l6-v2", headers=headers),
        lambda headers: c.get_model_repository_index(headers=headers),
    ]
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY}):
        for call in calls:
            with pytest.raises(InferenceServerException) as caught:
                call(headers)
            assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    key = {"authorization": f"Bearer {KEY}"}
    vectors = c.infer("all-minilm-l6-v2", [tensor], headers=key).as_numpy("embedding")
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-4)
    big = tgrpc.InferInput("text", [1], "BYTES")
    big.set_data_from_numpy(np.array([b"x" * 70_000], dtype=np.object_))
    with pytest.raises(InferenceServerException) as caught:
        c.infer("all-minilm-l6-v2", [big], headers=key)
    assert caught.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_the_key_check_compares_fixed_length_digests_in_constant_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    guard = auth.APIKeyAuth(app=None, api_key=KEY)  # type: ignore[arg-type]
    for given in (b"", b"x", KEY[:-1].encode(), KEY.encode() + b"x" * 1000, KEY.encode()):
        for header in ((b"authorization", b"Bearer " + given), (b"x-api-key", given)):
            scope = {"type": "http", "headers": [header]}
            assert guard._authorized(scope) is (given == KEY.encode())
    # Every comparison (both headers, each time), however much of the key matched, was
    # of two 32-byte digests.
    assert compared == [(32, 32)] * 20


def _raw_post(server: Server, head: bytes, body_parts: list[bytes]) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        chunks = []
        while True:
            data = sock.recv(65536)
            if not data:
                break
            chunks.append(data)
            if b"\r\n\r\n" in b"".join(chunks) and b"}" in data:
                break
        return b"".join(chunks)


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server: Server) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 104857600\r\n\r\n"
    )
    # Only 1 KiB of the announced 100 MiB is ever sent, yet the answer comes.
    reply = _raw_post(server, head, [b"{" + b" " * 1023])
    assert reply.startswith(b"HTTP/1.1 413")


@pytest.mark.parametrize("path", ["/v1/completions", "/v2/models/all-minilm-l6-v2/infer"])
def test_a_streamed_oversized_body_is_cut_off_at_the_limit(server: Server, path: str) -> None:
    head = (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"a" * 16384
    parts = [b"%x\r\n" % len(chunk) + chunk + b"\r\n"] * 6  # 96 KiB, over 64 KiB; never ended
    reply = _raw_post(server, head, parts)
    assert reply.startswith(b"HTTP/1.1 413")
    assert "unexpected error" not in "".join(server.log)  # a refusal, not a server fault


def test_prompts_and_outputs_stay_out_of_the_logs(server: Server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=60, headers=headers) as c:
        reply = c.post(
            "/v1/chat/completions",
            json={
                "model": CHAT,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"Repeat after me: {MARKER}"}],
            },
        )
        assert reply.status_code == 200
        output = reply.json()["choices"][0]["message"]["content"]
        bad = c.post("/v1/completions", json={"model": CHAT, "prompt": MARKER, "max_tokens": 0})
        assert bad.status_code == 400
    log = "".join(server.log)
    assert MARKER not in log
    assert output.strip() == "" or output not in log
