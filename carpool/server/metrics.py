"""Prometheus exposition of the core's statistics objects (prometheus-client).

A custom collector reads each model's statistics snapshot at scrape time, so the
core never touches prometheus and no metric is updated on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from carpool.server.served import ServedModels
from carpool.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    return out


class BatcherCollector(Collector):
    """Metrics of every dynamic-batched model."""

    def __init__(self, models: ServedModels) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "carpool_requests", "Requests by terminal outcome.", labels=["model", "outcome"]
        )
        batches = CounterMetricFamily("carpool_batches", "Batches executed.", labels=["model"])
        pending = GaugeMetricFamily(
            "carpool_pending_requests", "Requests waiting in the queue.", labels=["model"]
        )
        queue = HistogramMetricFamily(
            "carpool_queue_duration_seconds",
            "Time a request waited before its batch ran.",
            labels=["model"],
        )
        compute = HistogramMetricFamily(
            "carpool_compute_duration_seconds", "Time one batch took to run.", labels=["model"]
        )
        sizes = HistogramMetricFamily(
            "carpool_batch_size", "Requests in each executed batch.", labels=["model"]
        )
        for served in self._models:
            s = served.batcher.stats.snapshot()
            name = served.name
            for outcome, count in s.outcomes.items():
                requests.add_metric([name, outcome.value], count)
            batches.add_metric([name], s.execution_count)
            pending.add_metric([name], s.pending)
            for family, hist in (
                (queue, s.queue_hist),
                (compute, s.compute_hist),
                (sizes, s.batch_size_hist),
            ):
                family.add_metric([name], _buckets(hist), hist.total)
        yield from (requests, batches, pending, queue, compute, sizes)


def make_registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
