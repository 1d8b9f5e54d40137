"""What a ``carpool bench`` run measured, with vLLM's names and meanings: request
throughput, output and total token throughput, TTFT, TPOT (time per output token
after the first), ITL (between streamed pieces) and end-to-end latency, and goodput
(requests per second that met every SLO given). Pure functions over per-request
records."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class ClientRecord:
    """One request as the client saw it (times in seconds). ``status``: the HTTP
    status, or None when the connection failed; tokens from the server's usage;
    ``sent``: when it was sent."""

    status: int | None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    sent: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation, as numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def samples(outcomes: Sequence[ClientRecord], metric: str) -> list[float]:
    """``metric``'s values in seconds over the successful requests."""
    good = [o for o in outcomes if o.ok]
    if metric == "ttft":
        return [o.ttft for o in good if o.ttft is not None]
    if metric == "tpot":
        return [t for o in good if (t := o.tpot) is not None]
    if metric == "itl":
        return [gap for o in good for gap in o.itl]
    return [o.latency for o in good]


def timeline(
    outcomes: Sequence[ClientRecord], duration_s: float, bin_s: float = 1.0
) -> list[float]:
    """Output tokens per second in each ``bin_s`` of the run (``sent`` counted from
    its start). A streamed request's tokens are spread evenly over the pieces it
    arrived in; a request that did not stream counts them when it ended."""
    bins = [0.0] * max(1, math.ceil(duration_s / bin_s))
    for o in outcomes:
        if not o.ok or not o.output_tokens:
            continue
        if o.ttft is None:
            arrivals = [o.sent + o.latency]
        else:
            arrivals = list(accumulate(o.itl, initial=o.sent + o.ttft))
        share = o.output_tokens / len(arrivals)
        for t in arrivals:
            bins[min(int(t / bin_s), len(bins) - 1)] += share / bin_s
    return bins


def meets(outcome: ClientRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (in ms) in ``slos_ms``."""
    if not outcome.ok:
        return False
    values = {"ttft": outcome.ttft, "tpot": outcome.tpot, "e2el": outcome.latency}
    for metric, bound in slos_ms.items():
        value = values.get(metric)
        if value is not None and value * 1000 > bound:
            return False
    return True


def summarize(
    outcomes: Sequence[ClientRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's figures: counts, throughputs, per-metric mean/median/percentiles in
    ms, goodput when SLOs are given, and errors by status."""
    good = [o for o in outcomes if o.ok]
    output = sum(o.output_tokens for o in good)
    total = output + sum(o.prompt_tokens for o in good)
    result: dict[str, Any] = {
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "errors": {
            str(status or "connection"): n
            for status, n in Counter(o.status for o in outcomes if not o.ok).items()
        },
        "duration_s": duration_s,
        "request_throughput": len(good) / duration_s if duration_s else 0.0,
        "output_throughput": output / duration_s if duration_s else 0.0,
        "total_token_throughput": total / duration_s if duration_s else 0.0,
        "total_input_tokens": total - output,
        "total_output_tokens": output,
    }
    for metric in METRICS:
        values = [v * 1000 for v in samples(outcomes, metric)]
        result[f"mean_{metric}_ms"] = statistics.fmean(values) if values else float("nan")
        result[f"median_{metric}_ms"] = percentile(values, 50)
        for q in percentiles:
            result[f"p{q:g}_{metric}_ms"] = percentile(values, q)
    if goodput_ms:
        met = sum(meets(o, goodput_ms) for o in outcomes)
        result["goodput"] = met / duration_s if duration_s else 0.0
    return result
