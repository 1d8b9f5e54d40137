"""Where a model's batches run: the venue.

A model is run in one of two venues, chosen when its batcher is made:

- **the runtime thread** (no pool): carpool's own models. The device runtime runs
  one unit at a time, so two models never fight for the same cores.
- **its instances** (an ``InstancePool``): user code. Each instance has a thread of
  its own (for a process-isolated instance, the thread that talks to its worker
  process). The batcher, on the runtime thread, takes a free instance, hands it the
  batch and moves on: the runtime never waits on code it did not write. Completions
  come back as messages; a batch that outlives the pool's execution timeout is
  failed by the batcher and its instance abandoned (``abandon``), which the pool
  kills or replaces while the model's other instances go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

Forward = Callable[[Any], Any]


class InstancePool(Protocol):
    """A model's instances, as the batcher drives them. ``take``, ``give_back`` and
    ``abandon`` are called on the runtime thread only; ``run`` returns at once."""

    timeout_s: float
    """Seconds a batch may run on an instance; 0: no limit."""

    def attach(self, notify: Callable[[], None]) -> None:
        """Receive the function that wakes the runtime; the pool calls it when an
        instance becomes free of itself (a replacement ready)."""

    def has_free(self) -> bool:
        """Whether ``take`` would find an instance now."""

    def take(self) -> int | None:
        """A free, healthy instance, now busy until ``give_back`` or ``abandon``;
        None when every instance is busy or being replaced."""

    def run(self, index: int, job: Callable[[Forward], None]) -> None:
        """Run ``job(forward)`` on instance ``index``'s own thread, ``forward`` running
        a collated batch on that instance. Returns at once."""

    def give_back(self, index: int) -> None:
        """Instance ``index`` finished its batch: free again."""

    def abandon(self, index: int) -> None:
        """Instance ``index`` outlived ``timeout_s`` on a batch that has been failed:
        kill it (a process) or leave its thread behind (a thread), and start a
        replacement; the slot is free again once the replacement stands. Returns at
        once."""

    def abandon_note(self, index: int) -> str:
        """What happens to an abandoned instance, for the timed-out requests'
        message (``its worker process is being restarted``)."""
