"""Prometheus exposition of the core's statistics objects (prometheus-client).

A custom collector reads each model's statistics snapshot at scrape time, so the
core never touches prometheus and no metric is updated on the hot path.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from carpool.repository import user_metrics
from carpool.server.registry.served import ServedModels
from carpool.stats import Histogram, RuntimeStats

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
        for served in self._models.batched():
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


class EngineCollector(Collector):
    """Metrics of every generation engine, with vLLM's meanings and a carpool_ prefix."""

    def __init__(self, models: ServedModels) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        labels = ["model"]
        histograms = {
            "time_to_first_token": HistogramMetricFamily(
                "carpool_time_to_first_token_seconds", "Time to first token.", labels=labels
            ),
            "inter_token_latency": HistogramMetricFamily(
                "carpool_inter_token_latency_seconds",
                "Mean time between a request's output tokens.",
                labels=labels,
            ),
            "e2e_latency": HistogramMetricFamily(
                "carpool_e2e_request_latency_seconds",
                "Arrival to last output, per finished request.",
                labels=labels,
            ),
            "queue_time": HistogramMetricFamily(
                "carpool_request_queue_time_seconds",
                "Time a request waited before its first step.",
                labels=labels,
            ),
            "tokens_per_step": HistogramMetricFamily(
                "carpool_iteration_tokens", "Tokens run in each engine step.", labels=labels
            ),
        }
        counters = {
            "prompt_tokens": CounterMetricFamily(
                "carpool_prompt_tokens", "Prompt tokens of started requests.", labels=labels
            ),
            "generation_tokens": CounterMetricFamily(
                "carpool_generation_tokens", "Generated tokens.", labels=labels
            ),
            "steps": CounterMetricFamily(
                "carpool_engine_steps", "Engine steps that ran the model.", labels=labels
            ),
            "launched_steps": CounterMetricFamily(
                "carpool_engine_launched_steps",
                "Of the engine steps, those launched before the last one landed (async "
                "scheduling).",
                labels=labels,
            ),
            "prompt_steps": CounterMetricFamily(
                "carpool_engine_prompt_steps",
                "Of the engine steps, those that ran a prompt chunk (prefill or mixed, not "
                "decodes alone).",
                labels=labels,
            ),
            "preemptions": CounterMetricFamily(
                "carpool_num_preemptions",
                "Sequences preempted for lack of KV blocks.",
                labels=labels,
            ),
            "prefix_queries": CounterMetricFamily(
                "carpool_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                labels=labels,
            ),
            "prefix_hits": CounterMetricFamily(
                "carpool_prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                labels=labels,
            ),
            "spec_drafts": CounterMetricFamily(
                "carpool_spec_decode_num_drafts",
                "Drafts verified (speculative decoding).",
                labels=labels,
            ),
            "spec_draft_tokens": CounterMetricFamily(
                "carpool_spec_decode_num_draft_tokens",
                "Draft tokens verified (speculative decoding).",
                labels=labels,
            ),
            "spec_accepted_tokens": CounterMetricFamily(
                "carpool_spec_decode_num_accepted_tokens",
                "Draft tokens accepted (speculative decoding); over draft tokens: the "
                "acceptance rate.",
                labels=labels,
            ),
        }
        gauges = {
            "running": GaugeMetricFamily(
                "carpool_num_requests_running", "Sequences in the running batch.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "carpool_num_requests_waiting", "Sequences waiting to start.", labels=labels
            ),
            "kv_usage": GaugeMetricFamily(
                "carpool_kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0 to 1).",
                labels=labels,
            ),
        }
        finished = CounterMetricFamily(
            "carpool_request_success",
            "Finished sequences by reason (stop, length, abort, timeout, error).",
            labels=["model", "finished_reason"],
        )
        for served in self._models.generators:
            s = served.engine.worker.stats.snapshot()
            block = served.engine.worker.block_size
            name = [served.name]
            for key, family in histograms.items():
                hist: Histogram = getattr(s, key)
                family.add_metric(name, _buckets(hist), hist.total)
            for key, counter in counters.items():
                value = getattr(s, key)
                counter.add_metric(name, value * block if key.startswith("prefix") else value)
            for key, gauge in gauges.items():
                gauge.add_metric(name, getattr(s, key))
            for reason, count in s.finished.items():
                finished.add_metric([served.name, reason], count)
        yield from histograms.values()
        yield from counters.values()
        yield from gauges.values()
        yield finished


class RuntimeCollector(Collector):
    """The device runtime's choice of model: units of work run and time spent, per
    model (one generation step or one executed batch is a unit)."""

    def __init__(self, stats: RuntimeStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats.snapshot()
        units = CounterMetricFamily(
            "carpool_runtime_units", "Units of work the device runtime ran.", labels=["model"]
        )
        busy = CounterMetricFamily(
            "carpool_runtime_busy_seconds",
            "Time the device runtime spent running each model's units.",
            labels=["model"],
        )
        for name, count in s.units.items():
            units.add_metric([name], count)
            busy.add_metric([name], s.busy_s[name])
        yield from (units, busy)


class ProcessCollector(Collector):
    """Event-loop tasks and threads, read at scrape time on the event loop (a leak
    shows as a count that only grows)."""

    def collect(self) -> Iterator[Metric]:
        tasks = GaugeMetricFamily("carpool_event_loop_tasks", "asyncio tasks alive.")
        tasks.add_metric([], len(asyncio.all_tasks()))
        threads = GaugeMetricFamily("carpool_threads", "Python threads alive.")
        threads.add_metric([], threading.active_count())
        yield from (tasks, threads)


def make_registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


WORKER_METRICS_TIMEOUT_S = 1.0


def user_metrics_text(models: ServedModels) -> bytes:
    """The repository models' custom metrics (``pb_utils.MetricFamily``), in Triton's
    exposition: this process's and each worker process's, merged. Blocks while the
    workers answer (at most ``WORKER_METRICS_TIMEOUT_S`` each): not on the event loop."""
    snapshots = [user_metrics.REGISTRY.snapshot()]
    for served in models.user_models.values():
        for version in served.versions.values():
            snapshots += version.model.worker_metrics(WORKER_METRICS_TIMEOUT_S)
    return user_metrics.exposition(user_metrics.merge(snapshots)).encode()


class MetricsPortOnly:
    """ASGI middleware: on the metrics port (``port``), ``GET /metrics`` only; any
    other path there is a 404. The same app serves the main port whole."""

    def __init__(self, app: ASGIApp, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server") or ("", None)
        if scope["type"] == "http" and server[1] == self.port and scope["path"] != "/metrics":
            await PlainTextResponse("only /metrics is served on this port", 404)(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)
