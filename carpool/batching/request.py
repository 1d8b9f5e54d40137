"""A request waiting in a dynamic batcher's queue."""

from __future__ import annotations

import itertools
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
    """

    payload: Any
    cost: int
    level: int
    arrival: float
    deadline: float
    future: Future[Any] = field(default_factory=Future)
    id: int = field(default_factory=lambda: next(_ids))
