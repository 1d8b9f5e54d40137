"""A real ``carpool serve`` on 127.0.0.1 with an ephemeral port, per test module."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

READY = re.compile(r"carpool ready on (http://127\.0\.0\.1:\d+)")
MODEL = "all-minilm-l6-v2"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    log: list[str]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0)

    def stats(self) -> dict[str, object]:
        with self.client() as c:
            result: dict[str, object] = c.get(f"/v2/models/{MODEL}/stats").json()["model_stats"][0]
            return result

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics."""
        with self.client() as c:
            text = c.get("/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name + "{"):
                got = ",".join(sorted(line[len(name) + 1 : line.index("}")].split(",")))
                if got == want:
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{{{want}}} not in /metrics")


def start_server(*args: str, timeout_s: float = 120.0) -> Server:
    """Start ``carpool serve`` and wait for its ready line (read from its output)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "carpool.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    log: list[str] = []
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not selector.select(timeout=deadline - time.monotonic()):
            break
        line = process.stdout.readline()
        if not line:
            break
        log.append(line)
        match = READY.search(line)
        if match:
            return Server(match.group(1), process, log)
    process.kill()
    raise RuntimeError("carpool serve did not become ready:\n" + "".join(log))


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
    """A server with the default configuration."""
    s = start_server()
    yield s
    assert stop_server(s) == 0
