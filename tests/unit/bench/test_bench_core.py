"""carpool bench's pure parts: the metrics (vLLM's meanings) from known records,
the seeded workloads, the arrival process's rate and burstiness, and the config's
refusals."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from carpool.bench.client import sse_data
from carpool.bench.config import BenchConfig
from carpool.bench.load import gaps
from carpool.bench.metrics import ClientRecord as Record
from carpool.bench.metrics import percentile, summarize, timeline
from carpool.bench.run import points, requests_for
from carpool.config import ConfigError


def test_the_metrics_of_known_records() -> None:
    outcomes = [
        Record(200, prompt_tokens=10, output_tokens=5, ttft=0.1, itl=[0.02] * 4, latency=0.18),
        Record(200, prompt_tokens=20, output_tokens=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4),
        Record(503, latency=0.01),
        Record(None, latency=1.0),
    ]
    s = summarize(outcomes, 2.0, (50, 99), {"ttft": 200, "tpot": 40})
    assert s["completed"] == 2 and s["failed"] == 2
    assert s["errors"] == {"503": 1, "connection": 1}
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (latency - ttft) / (output - 1): 20 ms and 50 ms.
    assert s["mean_tpot_ms"] == pytest.approx(35.0)
    assert s["median_itl_ms"] == pytest.approx(20.0)  # 4 gaps of 20, 2 of 50
    assert s["p99_e2el_ms"] == pytest.approx(180 + 0.99 * 220)
    assert s["goodput"] == 0.5  # only the first met TTFT <= 200 ms and TPOT <= 40 ms


def test_the_timeline_counts_tokens_in_the_second_they_arrived() -> None:
    outcomes = [
        # 4 tokens in 2 pieces, at 0.5 s and 1.5 s; 3 tokens in one response at 2.2 s.
        Record(200, output_tokens=4, ttft=0.3, itl=[1.0], latency=1.5, sent=0.2),
        Record(200, output_tokens=3, latency=2.0, sent=0.2),
        Record(503, output_tokens=9, latency=0.1, sent=0.0),  # failed: not counted
    ]
    assert timeline(outcomes, 3.0) == [2.0, 2.0, 3.0]
    assert timeline(outcomes, 3.0, bin_s=2.0) == [2.0, 1.5]  # per second, in 2-s bins


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5


def test_workloads_are_seeded_and_shaped() -> None:
    config = BenchConfig(random_input_len=40, random_output_len=20, random_range_ratio=0.5)
    first = requests_for(config, 50, random.Random(3))
    assert first == requests_for(config, 50, random.Random(3))
    assert first != requests_for(config, 50, random.Random(4))
    assert all(20 <= len(r.prompt.split()) <= 60 and 10 <= r.max_tokens <= 30 for r in first)
    shared = requests_for(BenchConfig(dataset="prefix", num_prefixes=2), 6, random.Random(0))
    heads = {r.prompt.split("\n\n")[0] for r in shared}
    assert len(heads) == 2
    sharegpt = requests_for(BenchConfig(dataset="sharegpt"), 2000, random.Random(0))
    median_in = statistics.median(len(r.prompt.split()) for r in sharegpt)
    assert 200 <= median_in <= 260 and max(r.max_tokens for r in sharegpt) > 800


def test_a_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a b"}\n\n{"prompt": "c", "max_tokens": 3}\n')
    config = BenchConfig(dataset="jsonl", dataset_path=str(path), random_output_len=7)
    got = requests_for(config, 10, random.Random(0))
    assert [(r.prompt, r.max_tokens) for r in got] == [("a b", 7), ("c", 3)]


@pytest.mark.parametrize("burstiness", [1.0, 0.25])
def test_arrivals_keep_their_rate_and_burstiness_shapes_their_spread(burstiness: float) -> None:
    drawn = gaps(4.0, burstiness, random.Random(0))
    sample = [next(drawn) for _ in range(20000)]
    assert statistics.fmean(sample) == pytest.approx(0.25, rel=0.05)
    # Gamma: coefficient of variation 1/sqrt(shape): 1 for Poisson, 2 when burstier.
    cv = statistics.pstdev(sample) / statistics.fmean(sample)
    assert cv == pytest.approx(burstiness**-0.5, rel=0.05)
    assert next(gaps(float("inf"), 1.0, random.Random(0))) == 0.0


def test_loopback_only_takes_this_machine_in_any_spelling() -> None:
    for url in ("http://127.0.0.1:8000", "http://127.0.0.2", "http://[::1]:80", "http://localhost"):
        assert BenchConfig(base_url=url, loopback_only=True).base_url == url
    assert BenchConfig(base_url="http://10.0.0.1:8000").base_url  # a user's tool: any target


def test_runs_and_refusals() -> None:
    assert [p[0] for p in points(BenchConfig(sweep_concurrencies=(1, 4)))] == [
        "concurrency 1",
        "concurrency 4",
    ]
    assert points(BenchConfig(request_rate=2.0))[0][1] == 2.0
    for bad in (
        {"endpoint": "/v1/images"},
        {"goodput": ("itl:5",)},
        {"goodput": ("ttft:fast",)},
        {"dataset": "jsonl"},
        {"request_rate": 0.0},
        {"base_url": "http://10.0.0.1:8000", "loopback_only": True},
        {"base_url": "http://example.org", "loopback_only": True},
    ):
        with pytest.raises(ConfigError):
            BenchConfig(**bad)  # type: ignore[arg-type]


def test_event_payloads_come_whole_however_the_reads_cut_the_stream() -> None:
    stream = b'data: {"a": 1}\r\n\r\ndata: {"b": 2}\n\n: ping\n\ndata: [DONE]\n\n'
    for cut in range(len(stream) + 1):
        payloads, pending = sse_data(b"", stream[:cut])
        more, pending = sse_data(pending, stream[cut:])
        assert payloads + more == [b'{"a": 1}', b'{"b": 2}']
        assert pending == b""
