"""``carpool bench`` as a user runs it, against a real ``carpool serve``: the counts
it reports match the server's own /metrics, its JSON holds vLLM's metric names, the
figures are PNG files, and embeddings are benchmarked too."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Server, start_server, stop_server

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = start_server()
    yield s
    assert stop_server(s) == 0


def bench(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "carpool.cli", "bench", "--base-url", server.url, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_a_sweep_reports_what_the_server_counted(server: Server, tmp_path: Path) -> None:
    before = server.metric("carpool_generation_tokens_total", model=CHAT)
    done = bench(
        server,
        "--num-prompts", "6",
        "--num-warmups", "1",
        "--sweep-concurrencies", "1", "3",
        "--random-input-len", "16",
        "--random-output-len", "8",
        "--ignore-eos",
        "--goodput", "ttft:60000", "tpot:60000",
        "--result-file", str(tmp_path / "result.json"),
        "--plot-dir", str(tmp_path / "plots"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "result.json").read_text())["results"]
    assert [r["label"] for r in results] == ["concurrency 1", "concurrency 3"]
    for r in results:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 48
        assert r["goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all met
        for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
            assert r[key] > 0
    counted = server.metric("carpool_generation_tokens_total", model=CHAT) - before
    assert counted == 2 * (48 + 8)  # two runs of six timed requests and one warm-up
    figures = (
        "throughput_vs_latency.png",
        "request_throughput.png",
        "latency_distributions.png",
        "throughput_over_time.png",
    )
    for name in figures:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "output throughput (tok/s)" in done.stdout and "p99 ITL (ms)" in done.stdout


def test_embeddings_and_refusals(server: Server) -> None:
    done = bench(
        server, "--endpoint", "/v1/embeddings", "--model", EMBED,
        "--num-prompts", "12", "--concurrency", "4", "--random-input-len", "12",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "12 / 0" in done.stdout
    wrong = bench(server, "--endpoint", "/v1/images")
    assert wrong.returncode == 2 and "endpoint must be one of" in wrong.stderr
    missing = bench(server, "--model", "nope", "--num-prompts", "2", "--num-warmups", "0")
    assert missing.returncode == 1 and "404: 2" in missing.stdout
