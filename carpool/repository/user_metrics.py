"""Custom metrics of Python-backend models (Triton's ``pb_utils.MetricFamily`` and
``Metric``): counters, gauges and histograms with labels, kept per process.

A model in the server's process records into this process's ``REGISTRY``; a model in
its worker process into the worker's, which the server reads at scrape time over the
worker's control pipe (``snapshot``). ``merge`` folds the snapshots (a metric with the
same labels in several workers: counters and histograms add up, a gauge keeps the
last one read) and ``exposition`` writes them as Triton writes them on ``/metrics``
(a counter's samples keep the family's name: no ``_total``, which prometheus-client
would add).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Labels = tuple[tuple[str, str], ...]


class MetricError(ValueError):
    """A metric used against its kind, or named against Prometheus' rules."""


@dataclass
class Series:
    """One labelled series: a value, or a histogram's bucket counts and sum."""

    value: float = 0.0
    buckets: tuple[float, ...] = ()
    counts: list[int] = field(default_factory=list)
    count: int = 0


@dataclass
class FamilySnapshot:
    name: str
    description: str
    kind: str
    series: dict[Labels, Series]


class Family:
    """One metric family; its series by labels. Thread-safe."""

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self._lock = threading.Lock()
        self._series: dict[Labels, Series] = {}

    def series(self, labels: dict[str, str] | None, buckets: list[float] | None) -> Labels:
        """The key of the series ``labels`` name (made if new; a histogram's with its
        ``buckets``, sorted upper bounds)."""
        key = _labels(labels or {})
        with self._lock:
            if key not in self._series:
                self._series[key] = self._new(buckets)
        return key

    def _new(self, buckets: list[float] | None) -> Series:
        if self.kind != HISTOGRAM:
            if buckets is not None:
                raise MetricError(f"metric family '{self.name}': only a histogram has buckets")
            return Series()
        if not buckets or sorted(buckets) != list(buckets) or any(map(math.isnan, buckets)):
            raise MetricError(
                f"histogram '{self.name}' needs its buckets: upper bounds in increasing order"
            )
        bounds = tuple(float(b) for b in buckets)
        return Series(buckets=bounds, counts=[0] * (len(bounds) + 1))

    def add(self, key: Labels, amount: float) -> None:
        if self.kind == HISTOGRAM:
            raise MetricError(f"histogram '{self.name}' takes observe(), not increment()")
        if self.kind == COUNTER and amount < 0:
            raise MetricError(f"counter '{self.name}' cannot be decreased")
        with self._lock:
            self._series[key].value += amount

    def set(self, key: Labels, value: float) -> None:
        if self.kind != GAUGE:
            raise MetricError(f"only a gauge can be set; '{self.name}' is a {self.kind}")
        with self._lock:
            self._series[key].value = value

    def observe(self, key: Labels, value: float) -> None:
        if self.kind != HISTOGRAM:
            raise MetricError(f"only a histogram observes; '{self.name}' is a {self.kind}")
        with self._lock:
            series = self._series[key]
            place = next((i for i, b in enumerate(series.buckets) if value <= b), -1)
            series.counts[place] += 1
            series.count += 1
            series.value += value

    def read(self, key: Labels) -> float:
        if self.kind == HISTOGRAM:
            raise MetricError(f"histogram '{self.name}' has no single value")
        with self._lock:
            return self._series[key].value

    def snapshot(self) -> FamilySnapshot:
        with self._lock:
            copied = {
                k: Series(s.value, s.buckets, list(s.counts), s.count)
                for k, s in self._series.items()
            }
        return FamilySnapshot(self.name, self.description, self.kind, copied)


class MetricRegistry:
    """The families of one process, by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, Family] = {}

    def family(self, name: str, description: str, kind: str) -> Family:
        """The family ``name`` (made if new). Triton's rules: a name used again with
        the same kind is the same family (its first description kept); another kind
        is an error."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise MetricError(f"metric family name {name!r} is not a valid Prometheus name")
        if kind not in KINDS:
            raise MetricError(f"metric family kind must be one of {', '.join(KINDS)}")
        with self._lock:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = Family(name, str(description), kind)
            elif family.kind != kind:
                raise MetricError(f"metric family '{name}' is already a {family.kind}")
            return family

    def snapshot(self) -> list[FamilySnapshot]:
        with self._lock:
            families = list(self._families.values())
        return [f.snapshot() for f in families]


REGISTRY = MetricRegistry()  # this process's (made empty; filled only by models)


def merge(snapshots: list[list[FamilySnapshot]]) -> list[FamilySnapshot]:
    """Every process's families as one list (see the module docstring)."""
    merged: dict[str, FamilySnapshot] = {}
    for families in snapshots:
        for family in families:
            into = merged.setdefault(
                family.name, FamilySnapshot(family.name, family.description, family.kind, {})
            )
            if into.kind != family.kind:
                continue  # a worker disagrees on the kind: the first one read wins
            for key, series in family.series.items():
                into.series[key] = _combined(into.kind, into.series.get(key), series)
    return list(merged.values())


def _combined(kind: str, old: Series | None, new: Series) -> Series:
    if old is None or kind == GAUGE or old.buckets != new.buckets:
        return new
    counts = [a + b for a, b in zip(old.counts, new.counts, strict=True)]
    return Series(old.value + new.value, old.buckets, counts, old.count + new.count)


def exposition(families: list[FamilySnapshot]) -> str:
    """The families in Prometheus' text format, as Triton writes custom metrics."""
    lines: list[str] = []
    for family in sorted(families, key=lambda f: f.name):
        lines.append(f"# HELP {family.name} {_escape_help(family.description)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for key, series in sorted(family.series.items()):
            if family.kind != HISTOGRAM:
                lines.append(f"{family.name}{_text(key)} {floatToGoString(series.value)}")
                continue
            running = 0
            for bound, count in zip([*series.buckets, math.inf], series.counts, strict=True):
                running += count
                le = (*key, ("le", floatToGoString(bound)))
                lines.append(f"{family.name}_bucket{_text(le)} {running}")
            lines.append(f"{family.name}_sum{_text(key)} {floatToGoString(series.value)}")
            lines.append(f"{family.name}_count{_text(key)} {series.count}")
    return "\n".join(lines) + ("\n" if lines else "")


def _labels(labels: dict[str, str]) -> Labels:
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL.match(name) or name == "le":
            raise MetricError(f"metric label name {name!r} is not a valid Prometheus label")
        if not isinstance(value, str):
            raise MetricError(f"metric label '{name}' must be a string")
    return tuple(sorted(labels.items()))


def _text(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")
