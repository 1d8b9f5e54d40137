"""``build_app`` in a Ray Serve application of one's own: ``serve.run`` it on a local
Ray cluster and reach it through Ray Serve's own HTTP proxy."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from carpool.config import CarpoolConfig, ServerConfig
from tests.integration.conftest import MODEL

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from carpool.distributed.deployment import Placement, build_app

    port = free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=96 << 20,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = CarpoolConfig(server=ServerConfig(models=(MODEL,)))
        serve.run(build_app(config, Placement(replicas=2, cpus=1.0)), route_prefix="/")
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


def test_the_application_serves_through_ray_serves_proxy(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        health = c.get("/health").json()
        assert health["replicas_ready"] == 2
        reply = c.post("/v1/embeddings", json={"model": MODEL, "input": ["one", "two"]})
        assert reply.status_code == 200
        assert [len(d["embedding"]) for d in reply.json()["data"]] == [384, 384]
        bad = c.post("/v1/embeddings", json={"model": MODEL, "input": 3})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == "input"
        assert 'replica="' in c.get("/metrics").text
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
