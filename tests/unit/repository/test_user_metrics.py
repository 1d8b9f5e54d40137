"""Custom metrics of Python-backend models, through ``pb_utils`` as Triton's
custom_metrics example uses it, and their exposition as Triton writes it."""

from __future__ import annotations

import pytest

from carpool.repository import pb_utils, user_metrics
from carpool.repository.user_metrics import MetricRegistry, exposition, merge


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> MetricRegistry:
    registry = MetricRegistry()
    monkeypatch.setattr(user_metrics, "REGISTRY", registry)
    return registry


def test_a_counter_as_tritons_example_uses_it(fresh_registry: MetricRegistry) -> None:
    family = pb_utils.MetricFamily(
        name="requests_process_latency_ns",
        description="Cumulative time spent processing requests",
        kind=pb_utils.MetricFamily.COUNTER,
    )
    metric = family.Metric(labels={"model": "custom_metrics", "version": "1"})
    metric.increment(1500)
    metric.increment(500)
    assert metric.value() == 2000
    text = exposition(fresh_registry.snapshot())
    assert text.splitlines() == [
        "# HELP requests_process_latency_ns Cumulative time spent processing requests",
        "# TYPE requests_process_latency_ns counter",
        'requests_process_latency_ns{model="custom_metrics",version="1"} 2000.0',
    ]
    with pytest.raises(pb_utils.TritonModelException, match="cannot be decreased"):
        metric.increment(-1)
    with pytest.raises(pb_utils.TritonModelException, match="only a gauge"):
        metric.set(3)


def test_gauges_histograms_and_tritons_naming_rules(fresh_registry: MetricRegistry) -> None:
    gauge = pb_utils.MetricFamily("queue_depth", "Depth", pb_utils.MetricFamily.GAUGE)
    again = pb_utils.MetricFamily("queue_depth", "Another text", pb_utils.MetricFamily.GAUGE)
    depth = gauge.Metric({"q": 'a"b'})
    depth.set(5)
    again.Metric({"q": 'a"b'}).increment(-2)  # the same family and series
    assert depth.value() == 3
    with pytest.raises(pb_utils.TritonModelException, match="already a gauge"):
        pb_utils.MetricFamily("queue_depth", "x", pb_utils.MetricFamily.COUNTER)
    with pytest.raises(pb_utils.TritonModelException, match="not a valid Prometheus name"):
        pb_utils.MetricFamily("bad name", "x", pb_utils.MetricFamily.GAUGE)
    histogram = pb_utils.MetricFamily("took_s", "Time", pb_utils.MetricFamily.HISTOGRAM)
    with pytest.raises(pb_utils.TritonModelException, match="buckets"):
        histogram.Metric({"m": "x"})
    timing = histogram.Metric({"m": "x"}, buckets=[0.1, 1.0])
    for value in (0.05, 0.5, 5.0):
        timing.observe(value)
    with pytest.raises(pb_utils.TritonModelException, match="no single value"):
        timing.value()
    lines = exposition(fresh_registry.snapshot()).splitlines()
    assert 'queue_depth{q="a\\"b"} 3.0' in lines
    assert "# HELP queue_depth Depth" in lines  # the first description stays
    assert [line for line in lines if line.startswith("took_s")] == [
        'took_s_bucket{m="x",le="0.1"} 1',
        'took_s_bucket{m="x",le="1.0"} 2',
        'took_s_bucket{m="x",le="+Inf"} 3',
        'took_s_sum{m="x"} 5.55',
        'took_s_count{m="x"} 3',
    ]


def test_workers_metrics_merge_counters_add_gauges_take_the_last() -> None:
    def worker(count: float, depth: float) -> list[user_metrics.FamilySnapshot]:
        registry = MetricRegistry()
        registry.family("done", "Done", "counter").add(
            registry.family("done", "Done", "counter").series({"m": "a"}, None), count
        )
        gauge = registry.family("depth", "Depth", "gauge")
        gauge.set(gauge.series(None, None), depth)
        return registry.snapshot()

    merged = {f.name: f for f in merge([worker(2, 7), worker(3, 9)])}
    assert merged["done"].series[(("m", "a"),)].value == 5
    assert merged["depth"].series[()].value == 9
