"""A request waiting in a dynamic batcher's queue."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count()


@dataclass(eq=False)
class BatchRequest:
    """One input to a dynamic-batched model.

    ``cost`` is the input's size in the model's unit (tokens for a text model);
    ``level`` its priority level (1 runs first); ``deadline`` the monotonic time by
    which it must have started, else it times out. The ``future`` carries its one
    terminal outcome back to whoever submitted it; cancelling the future before the
    request runs drops it.

    ``size`` is how many of the batch's ``max_batch_size`` slots it takes (a tensor
    request's batch dimension; 1 for one text). ``group``: only requests of equal
    group share a batch (Triton's rule for inputs of different shapes); None
    batches with anything.
    """

    payload: Any
    cost: int
    level: int
    arrival: float
    deadline: float
    size: int = 1
    group: Hashable | None = None
    future: Future[Any] = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))

    def waited(self, now: float) -> float:
        """Seconds since arrival, never below zero: the runtime reads its clock
        before it drains the inbox, so a request may arrive after that ``now``."""
        return max(0.0, now - self.arrival)


@dataclass(frozen=True)
class Failed:
    """What a model's ``split`` returns in place of an output for one request that
    failed on its own (a Triton response carrying an error): that request ends with
    ``error``, its neighbours with their outputs."""

    error: Exception
