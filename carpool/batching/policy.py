"""When to send a batch and which waiting requests go in it. Pure: no threads, no clock.

Semantics after Triton's dynamic batcher:
- the best-priority, oldest request (the anchor) always goes in the next batch, so
  nothing starves;
- a batch holds at most ``max_batch_size`` slots (a request takes as many as its
  ``size``, its batch dimension) and ``max_batch_tokens`` tokens (padded models pay
  for their longest input times the batch size, ragged ones for the sum of lengths);
- only requests of the anchor's ``group`` join it (Triton: inputs of different
  shapes share a batch only where the model takes ragged batches);
- the other members are the requests closest in length to the anchor, best
  priority first: that keeps padding small, and even a ragged model runs a
  batch of similar lengths faster;
- with no queue delay a batch goes as soon as the device is free; with a delay it
  goes when it is full, when it reaches a preferred size (trimmed to the largest
  preferred size it can fill), or when the anchor has waited ``max_queue_delay``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from carpool.batching.request import BatchRequest
from carpool.config import BatchingConfig


@dataclass(frozen=True)
class SendBatch:
    """Send these requests now, in this order."""

    requests: list[BatchRequest]


@dataclass(frozen=True)
class WaitUntil:
    """Nothing to send before ``time`` (unless new requests arrive)."""

    time: float


Decision = SendBatch | WaitUntil | None


def batch_cost(costs: Sequence[int], ragged: bool) -> int:
    """Tokens a batch of inputs of these lengths occupies."""
    if not costs:
        return 0
    return sum(costs) if ragged else max(costs) * len(costs)


def select(
    waiting: Sequence[BatchRequest], config: BatchingConfig, ragged: bool
) -> tuple[list[BatchRequest], bool]:
    """The next batch from ``waiting`` (best level first, oldest first) and whether it is
    full: no further waiting request would fit, or the size limit is reached.

    The batch is in selection order: the anchor first, then by closeness, so a
    prefix of it is itself a good batch."""
    if not waiting:
        return [], False
    anchor = waiting[0]
    others = [r for r in waiting[1:] if r.group == anchor.group]
    others.sort(key=lambda r: (r.level, abs(r.cost - anchor.cost), r.arrival))
    chosen = [anchor]
    costs = [anchor.cost]
    used = anchor.size
    full = False
    for request in others:
        if used >= config.max_batch_size:
            full = True
            break
        if used + request.size > config.max_batch_size:
            full = True
            continue
        if batch_cost([*costs, request.cost], ragged) > config.max_batch_tokens:
            full = True
            continue
        chosen.append(request)
        costs.append(request.cost)
        used += request.size
    if used >= config.max_batch_size:
        full = True
    return chosen, full


def slots(requests: Sequence[BatchRequest]) -> int:
    """Batch slots ``requests`` take together."""
    return sum(r.size for r in requests)


def decide(
    waiting: Sequence[BatchRequest], now: float, config: BatchingConfig, ragged: bool
) -> Decision:
    """Whether to send a batch now, and which; None when nothing waits."""
    chosen, full = select(waiting, config, ragged)
    if not chosen:
        return None
    delay_s = config.max_queue_delay_ms / 1000.0
    oldest = min(r.arrival for r in waiting)
    if delay_s == 0 or full or now - oldest >= delay_s:
        return SendBatch(chosen)
    preferred = _preferred_prefix(chosen, config.preferred_batch_sizes)
    if preferred:
        return SendBatch(preferred)
    return WaitUntil(oldest + delay_s)


def _preferred_prefix(
    chosen: list[BatchRequest], preferred_sizes: Sequence[int]
) -> list[BatchRequest]:
    """The longest prefix of ``chosen`` whose slots are exactly a preferred batch
    size; empty if none is."""
    best: list[BatchRequest] = []
    taken = 0
    for i, request in enumerate(chosen):
        taken += request.size
        if taken in preferred_sizes:
            best = chosen[: i + 1]
    return best
