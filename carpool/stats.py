"""Plain statistics objects filled by the core and read by ``server/metrics.py``.

The runtime thread writes a model's statistics, except rejections, which the
submitting thread records as it refuses; every write and every ``snapshot()``
(the readers' copy) holds the object's lock.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum


class Outcome(StrEnum):
    """How a request ended."""

    SUCCESS = "success"
    ERROR = "error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


@dataclass
class Histogram:
    """Cumulative-free bucket counts; ``bounds`` are upper bounds, +Inf implied."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)


# Numbers each statistics holder (a model's load), so readers tell one from the next.
_SERIALS = itertools.count()

LATENCY_BOUNDS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Inter-token latencies sit between a few and a few tens of milliseconds: finer
# buckets there, so a percentile read from them is within a couple of milliseconds.
ITL_BOUNDS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.0125,
    0.015,
    0.0175,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Duration:
    """A count and a cumulative duration in nanoseconds (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class BatchSizeStats:
    """Triton's InferBatchStatistics for one executed batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class BatcherStatsData:
    """What a dynamic-batched model has done, in Triton's statistics terms."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    pending: int = 0
    outcomes: dict[Outcome, int] = field(default_factory=lambda: {o: 0 for o in Outcome})
    batch_sizes: dict[int, BatchSizeStats] = field(default_factory=dict)
    queue_hist: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))
    compute_hist: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))
    batch_size_hist: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BOUNDS))


class BatcherStats:
    """Thread-safe holder of ``BatcherStatsData``: the runtime writes, anyone snapshots.
    ``serial`` tells one holder from another (a model loaded again gets a new one)."""

    def __init__(self) -> None:
        self.serial = next(_SERIALS)
        self._lock = threading.Lock()
        self._data = BatcherStatsData()

    def snapshot(self) -> BatcherStatsData:
        with self._lock:
            return copy.deepcopy(self._data)

    def record_outcome(self, outcome: Outcome, total_s: float) -> None:
        with self._lock:
            self._data.outcomes[outcome] += 1
            if outcome is Outcome.SUCCESS:
                self._data.success.add(total_s)
            elif outcome in (Outcome.ERROR, Outcome.TIMEOUT):
                self._data.fail.add(total_s)

    def record_queue(self, waited_s: float) -> None:
        with self._lock:
            self._data.queue.add(waited_s)
            self._data.queue_hist.observe(waited_s)

    def record_execution(
        self, size: int, input_s: float, infer_s: float, output_s: float, wall_ms: int
    ) -> None:
        """One executed batch of ``size`` requests and how long each phase took."""
        with self._lock:
            d = self._data
            d.execution_count += 1
            d.inference_count += size
            d.last_inference_ms = wall_ms
            d.compute_input.add(input_s, size)
            d.compute_infer.add(infer_s, size)
            d.compute_output.add(output_s, size)
            per_size = d.batch_sizes.setdefault(size, BatchSizeStats())
            per_size.compute_input.add(input_s)
            per_size.compute_infer.add(infer_s)
            per_size.compute_output.add(output_s)
            d.compute_hist.observe(input_s + infer_s + output_s)
            d.batch_size_hist.observe(size)

    def set_pending(self, pending: int) -> None:
        with self._lock:
            self._data.pending = pending


TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class EngineStatsData:
    """What a generation engine has done, with vLLM's metric meanings."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    launched_steps: int = 0  # of ``steps``, those launched before the last one landed
    prompt_steps: int = 0  # of ``steps``, those that ran a prompt chunk (not decodes alone)
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BOUNDS_S))
    e2e_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))
    queue_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BOUNDS_S))
    tokens_per_step: Histogram = field(default_factory=lambda: Histogram(TOKEN_BOUNDS))

    def copy(self) -> EngineStatsData:
        """A copy sharing nothing mutable with this one (every field is a number, a
        histogram, or a flat dict or list of numbers): an engine process snapshots its
        statistics whenever a request finishes, and ``copy.deepcopy`` took ~70 us."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, Histogram | dict | list):
                setattr(twin, name, value.copy())
        return twin


class EngineStats:
    """Thread-safe holder of ``EngineStatsData``: the engine's thread writes through
    ``update``, anyone snapshots."""

    def __init__(self) -> None:
        self.serial = next(_SERIALS)
        self._lock = threading.Lock()
        self._data = EngineStatsData()

    def snapshot(self) -> EngineStatsData:
        with self._lock:
            return self._data.copy()

    @contextmanager
    def update(self) -> Iterator[EngineStatsData]:
        with self._lock:
            yield self._data

    def load(self, data: EngineStatsData) -> None:
        """Hold ``data`` from now on: a snapshot of an engine in another process."""
        with self._lock:
            self._data = data


@dataclass
class RuntimeStatsData:
    """Which worker the device runtime chose for each unit of work, and for how long."""

    units: dict[str, int] = field(default_factory=dict)
    busy_s: dict[str, float] = field(default_factory=dict)


class RuntimeStats:
    """Thread-safe holder of ``RuntimeStatsData``: the runtime thread writes, anyone
    snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = RuntimeStatsData()

    def snapshot(self) -> RuntimeStatsData:
        with self._lock:
            return copy.deepcopy(self._data)

    def record_unit(self, worker: str, seconds: float) -> None:
        with self._lock:
            d = self._data
            d.units[worker] = d.units.get(worker, 0) + 1
            d.busy_s[worker] = d.busy_s.get(worker, 0.0) + seconds
