"""``build_app`` in a Ray Serve application of one's own: ``serve.run`` it on a local
Ray cluster and reach it through Ray Serve's own HTTP proxy."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from carpool.config import CarpoolConfig, ServerConfig
from carpool.testing import free_port
from tests.integration.conftest import MODEL

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from carpool.distributed.deployment import Placement, build_app
    from carpool.distributed.launch import local_cluster

    port = free_port()
    ray.init(**local_cluster(num_cpus=2, object_store_bytes=96 << 20))
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
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        assert 'replica="' in c.get("/metrics").text
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
