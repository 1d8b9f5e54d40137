"""A real ``carpool serve`` on 127.0.0.1 with an ephemeral port, per test module."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.testing import spawn

READY = re.compile(r"carpool ready on (http://127\.0\.0\.1:\d+)")
GRPC = re.compile(r"gRPC on (127\.0\.0\.1:\d+)")
METRICS = re.compile(r"metrics on (http://127\.0\.0\.1:\d+)/metrics")
MODEL = "all-minilm-l6-v2"
CHAT = "smollm2-135m-instruct"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    log: list[str]

    @property
    def grpc_url(self) -> str:
        """The gRPC service's host:port (a server started with ``--grpc-port -1``)."""
        found = next(m for line in self.log if (m := GRPC.search(line)))
        return found.group(1)

    @property
    def metrics_url(self) -> str:
        """The metrics port's base URL (a server started with ``--metrics-port -1``)."""
        found = next(m for line in self.log if (m := METRICS.search(line)))
        return found.group(1)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0)

    def stats(self) -> dict[str, object]:
        with self.client() as c:
            result: dict[str, object] = c.get(f"/v2/models/{MODEL}/stats").json()["model_stats"][0]
            return result

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics, read with prometheus-client's own parser."""
        with self.client() as c:
            text = c.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        raise KeyError(f"{name}{labels} not in /metrics")


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll the server's observable state until ``condition`` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def rss_bytes(server: Server) -> int:
    """The server process's resident memory."""
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def greedy_body(prompt: str | list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A /v1/completions body for the built-in chat model: greedy, EOS ignored, so
    its answer is fixed and as long as asked."""
    return {
        "model": CHAT,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


ROOT = Path(__file__).resolve().parents[2]


def start_server(*args: str, timeout_s: float = 120.0, faults: str = "") -> Server:
    """Start ``carpool serve`` on an ephemeral port and wait for its ready line. No
    gRPC service unless ``args`` ask for one (``--grpc-port -1``: a free port).
    ``faults``: a fault plan (``tests/faults.py``) for every model it loads."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    if faults:
        site = os.pathsep.join([str(ROOT / "tests" / "fault_site"), str(ROOT)])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        env["CARPOOL_TEST_FAULTS"] = faults
    command = [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", "--grpc-port", "0"]
    command += args
    process, match, log = spawn(command, READY, timeout_s, env)
    return Server(match.group(1), process, log)


def stop_server(server: Server) -> int:
    """SIGTERM and wait; the exit code."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(timeout=60)
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server of the embedding model, otherwise with the default configuration."""
    s = start_server("--model", MODEL)
    yield s
    assert stop_server(s) == 0


@pytest.fixture(scope="session")
def repository_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test model repository (``tests/repository_models``)."""
    from tests.repository_models.builder import build

    return build(tmp_path_factory.mktemp("repository"))


@pytest.fixture(scope="session")
def repository_server(repository_root: Path) -> Iterator[Server]:
    """The test model repository served over HTTP and gRPC (one server for every
    module that reads it)."""
    s = start_server(
        "--model-repository", str(repository_root), "--grpc-port", "-1",
        "--metrics-port", "-1", "--kv-cache-memory", "64MiB",
    )  # fmt: skip
    yield s
    assert stop_server(s) == 0
