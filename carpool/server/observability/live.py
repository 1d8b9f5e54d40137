"""Live statistics for the dashboard (``GET /dashboard/stats``).

A sample of every model's statistics is taken when a viewer asks for the view and
the last sample is older than ``SAMPLE_EVERY_S``; nothing runs while nobody watches,
and viewers polling at once share samples. The view derives, from consecutive
samples, rates and per-interval means (series over the last ``KEEP_S`` seconds) and,
from the histograms' bucket deltas over the last ``WINDOW_S`` seconds, percentiles
the way Prometheus' ``histogram_quantile`` reads the same buckets of ``/metrics``.
Totals are the same counters ``/metrics`` exports, so the two agree.

Owned by the event loop: only async handlers call ``LiveStats.view``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

from carpool.stats import (
    BatcherStatsData,
    EngineStatsData,
    Histogram,
    Outcome,
    RuntimeStats,
    RuntimeStatsData,
)

T = TypeVar("T")

SAMPLE_EVERY_S = 0.5
KEEP_S = 120.0
WINDOW_S = 60.0
QUANTILES = (0.5, 0.9, 0.99)
# Finished reasons that are not a normal end of generation.
ENGINE_ERRORS = ("abort", "timeout", "error")
BATCHER_ERRORS = (Outcome.ERROR, Outcome.TIMEOUT, Outcome.REJECTED, Outcome.CANCELLED)


@dataclass(frozen=True)
class Reading:
    """Snapshots of every model's statistics (``Sample`` without its time)."""

    engines: dict[str, EngineStatsData]
    block_sizes: dict[str, int]
    batchers: dict[str, BatcherStatsData]
    serials: dict[str, int] = field(default_factory=dict)  # which load of each model


@dataclass(frozen=True)
class Sample:
    """Every model's statistics at wall-clock time ``t`` (seconds since the epoch).
    ``serials``: which load of each model the statistics are of (a model unloaded and
    loaded again counts from zero)."""

    t: float
    engines: dict[str, EngineStatsData]
    block_sizes: dict[str, int]
    batchers: dict[str, BatcherStatsData]
    runtime: RuntimeStatsData
    serials: dict[str, int] = field(default_factory=dict)


def _same_load(name: str, *samples: Sample) -> bool:
    """Whether ``samples`` hold statistics of one and the same load of ``name``."""
    first = samples[0].serials.get(name)
    return all(s.serials.get(name) == first for s in samples)


def _one_load(
    name: str,
    table: Callable[[Sample], Mapping[str, T]],
    pairs: list[tuple[Sample, Sample]],
    baseline: Sample | None,
    last: Sample,
) -> tuple[list[tuple[Sample, Sample]], T | None]:
    """The sample pairs that both hold ``last``'s load of ``name`` (in ``table``), and
    the baseline's statistics of it (None when the baseline holds another load)."""
    held = [
        (a, b)
        for a, b in pairs
        if name in table(a) and name in table(b) and _same_load(name, a, b, last)
    ]
    same = baseline is not None and _same_load(name, baseline, last)
    old = table(baseline).get(name) if baseline is not None and same else None
    return held, old


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The ``q``-quantile of bucket counts (``counts[i]`` observations at most
    ``bounds[i]``, the last one above every bound), interpolated linearly within its
    bucket as Prometheus' ``histogram_quantile`` does; None with no observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i == len(bounds):  # above the last bound: the bound is all we know
                return float(bounds[-1])
            lower = 0.0 if i == 0 else float(bounds[i - 1])
            return lower + (float(bounds[i]) - lower) * (rank - seen) / count
        seen += count
    return float(bounds[-1])


def histogram_delta(new: Histogram, old: Histogram | None) -> list[int]:
    if old is None:
        return list(new.counts)
    return [a - b for a, b in zip(new.counts, old.counts, strict=True)]


def _quantiles(new: Histogram, old: Histogram | None) -> dict[str, float | None]:
    counts = histogram_delta(new, old)
    return {f"p{round(q * 100)}": quantile(new.bounds, counts, q) for q in QUANTILES}


def _rate(new: float, old: float, dt: float) -> float:
    return (new - old) / dt if dt > 0 else 0.0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def engine_totals(s: EngineStatsData, block_size: int) -> dict[str, Any]:
    """The counters ``/metrics`` exports for a generation engine (prefix-cache
    counts in tokens, as there)."""
    return {
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "steps": s.steps,
        "preemptions": s.preemptions,
        "prefix_cache_queries": s.prefix_queries * block_size,
        "prefix_cache_hits": s.prefix_hits * block_size,
        "finished": dict(s.finished),
        "rejected": s.rejected,
        "spec_draft_tokens": s.spec_draft_tokens,
        "spec_accepted_tokens": s.spec_accepted_tokens,
    }


def engine_errors(s: EngineStatsData) -> dict[str, int]:
    errors = {reason: s.finished.get(reason, 0) for reason in ENGINE_ERRORS}
    errors["rejected"] = s.rejected
    return errors


def engine_point(new: EngineStatsData, old: EngineStatsData, dt: float) -> dict[str, Any]:
    """One point of a generation model's series: gauges at ``new``, rates and
    per-step means between ``old`` and ``new``."""
    steps = new.tokens_per_step.count - old.tokens_per_step.count
    step_tokens = new.tokens_per_step.total - old.tokens_per_step.total
    return {
        "running": new.running,
        "waiting": new.waiting,
        "kv_usage": new.kv_usage,
        "generation_tokens_per_s": _rate(new.generation_tokens, old.generation_tokens, dt),
        "prompt_tokens_per_s": _rate(new.prompt_tokens, old.prompt_tokens, dt),
        "tokens_per_step": _ratio(step_tokens, steps),
        "preemptions": new.preemptions - old.preemptions,
    }


def engine_window(new: EngineStatsData, old: EngineStatsData | None) -> dict[str, Any]:
    """Percentiles and rates over the window from ``old`` (None: since start)."""
    queries = new.prefix_queries - (old.prefix_queries if old else 0)
    hits = new.prefix_hits - (old.prefix_hits if old else 0)
    drafted = new.spec_draft_tokens - (old.spec_draft_tokens if old else 0)
    accepted = new.spec_accepted_tokens - (old.spec_accepted_tokens if old else 0)
    old_errors = engine_errors(old) if old else {}
    return {
        "ttft_s": _quantiles(new.time_to_first_token, old.time_to_first_token if old else None),
        "itl_s": _quantiles(new.inter_token_latency, old.inter_token_latency if old else None),
        "e2e_s": _quantiles(new.e2e_latency, old.e2e_latency if old else None),
        "prefix_cache_hit_rate": _ratio(hits, queries),
        "spec_acceptance": _ratio(accepted, drafted),
        "errors": {k: v - old_errors.get(k, 0) for k, v in engine_errors(new).items()},
    }


def batcher_totals(s: BatcherStatsData) -> dict[str, Any]:
    """The counters ``/metrics`` exports for a dynamic-batched model."""
    return {
        "requests": {o.value: n for o, n in s.outcomes.items()},
        "batches": s.execution_count,
        "inferences": s.inference_count,
    }


def batcher_point(new: BatcherStatsData, old: BatcherStatsData, dt: float) -> dict[str, Any]:
    batches = new.execution_count - old.execution_count
    inferences = new.inference_count - old.inference_count
    queued = new.queue.count - old.queue.count
    queue_s = _ratio((new.queue.ns - old.queue.ns) / 1e9, queued)
    return {
        "pending": new.pending,
        "requests_per_s": _rate(new.inference_count, old.inference_count, dt),
        "batch_size": _ratio(inferences, batches),
        "queue_ms": None if queue_s is None else queue_s * 1000,
    }


def batcher_window(new: BatcherStatsData, old: BatcherStatsData | None) -> dict[str, Any]:
    sizes = histogram_delta(new.batch_size_hist, old.batch_size_hist if old else None)
    bounds = [*(str(int(b)) for b in new.batch_size_hist.bounds), "more"]
    return {
        "queue_s": _quantiles(new.queue_hist, old.queue_hist if old else None),
        "compute_s": _quantiles(new.compute_hist, old.compute_hist if old else None),
        "batch_sizes": {b: n for b, n in zip(bounds, sizes, strict=True) if n},
        "errors": {
            o.value: new.outcomes[o] - (old.outcomes[o] if old else 0) for o in BATCHER_ERRORS
        },
    }


def runtime_point(new: RuntimeStatsData, old: RuntimeStatsData, dt: float) -> dict[str, float]:
    """Each worker's share of the device's time between two samples (0 to 1)."""
    return {name: _rate(busy, old.busy_s.get(name, 0.0), dt) for name, busy in new.busy_s.items()}


def _series(points: list[dict[str, Any]], keys: Iterable[str]) -> dict[str, list[Any]]:
    return {k: [p[k] for p in points] for k in keys}


def view(samples: Sequence[Sample], window_s: float = WINDOW_S) -> dict[str, Any]:
    """What the dashboard shows, from samples oldest first (at least one). A model
    loaded or unloaded meanwhile has points only where two samples in a row hold the
    same load of it, and percentiles only from a baseline of that load."""
    last = samples[-1]
    baseline = next((s for s in samples[:-1] if s.t >= last.t - window_s), None)
    pairs = list(pairwise(samples))
    times = [new.t for _, new in pairs]
    models: dict[str, Any] = {}
    for name, stats in last.engines.items():
        held, old = _one_load(name, lambda s: s.engines, pairs, baseline, last)
        points = [engine_point(b.engines[name], a.engines[name], b.t - a.t) for a, b in held]
        models[name] = {
            "kind": "generation",
            "totals": engine_totals(stats, last.block_sizes[name]),
            "window": engine_window(stats, old),
            "series": {
                "t": [b.t for _, b in held],
                **_series(points, engine_point(stats, stats, 1.0)),
            },
        }
    for name, bstats in last.batchers.items():
        held, bold = _one_load(name, lambda s: s.batchers, pairs, baseline, last)
        points = [batcher_point(b.batchers[name], a.batchers[name], b.t - a.t) for a, b in held]
        models[name] = {
            "kind": "embedding",
            "totals": batcher_totals(bstats),
            "window": batcher_window(bstats, bold),
            "series": {
                "t": [b.t for _, b in held],
                **_series(points, batcher_point(bstats, bstats, 1.0)),
            },
        }
    shares = [runtime_point(b.runtime, a.runtime, b.t - a.t) for a, b in pairs]
    workers = sorted(last.runtime.units)
    return {
        "time": last.t,
        "window_s": last.t - baseline.t if baseline else None,
        "models": models,
        "runtime": {
            "units": dict(last.runtime.units),
            "busy_s": dict(last.runtime.busy_s),
            "series": {"t": times, **{w: [p.get(w, 0.0) for p in shares] for w in workers}},
        },
    }


class LiveStats:
    """Samples taken on demand, kept for ``KEEP_S`` seconds; ``read`` returns the
    statistics of every model and of the runtime."""

    def __init__(
        self,
        read: Callable[[], Reading],
        runtime: RuntimeStats | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._read = read
        self._runtime = runtime
        self._clock = clock
        self._samples: deque[Sample] = deque()

    def _sample(self) -> None:
        now = self._clock()
        if self._samples and now - self._samples[-1].t < SAMPLE_EVERY_S:
            return
        r = self._read()
        runtime = self._runtime.snapshot() if self._runtime else RuntimeStatsData()
        sample = Sample(now, r.engines, r.block_sizes, r.batchers, runtime, r.serials)
        self._samples.append(sample)
        while now - self._samples[0].t > KEEP_S:
            self._samples.popleft()

    def view(self) -> dict[str, Any]:
        self._sample()
        return view(list(self._samples))
