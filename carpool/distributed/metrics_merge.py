"""Many replicas' Prometheus expositions as one: each sample gains a ``replica`` label.
Parsed and written by prometheus-client itself."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """One exposition holding every sample of ``texts`` (replica -> its /metrics text),
    each labelled ``replica="<replica>"``, plus ``carpool_replicas`` (how many answered)."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            into.samples.extend(
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            )
    count = Metric("carpool_replicas", "Replicas that answered this scrape.", "gauge")
    count.add_sample("carpool_replicas", {}, float(len(texts)))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), count]))
    return generate_latest(registry)
