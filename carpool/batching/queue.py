"""Per-priority-level FIFO queues of waiting requests, owned by the runtime thread."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from carpool.batching.request import BatchRequest


class PriorityQueues:
    """Waiting requests, one FIFO per priority level (1 is served first)."""

    def __init__(self, levels: int) -> None:
        self._queues: dict[int, deque[BatchRequest]] = {
            lvl: deque() for lvl in range(1, levels + 1)
        }

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add(self, request: BatchRequest) -> None:
        self._queues[request.level].append(request)

    def in_order(self) -> Iterator[BatchRequest]:
        """All waiting requests, best level first, oldest first within a level."""
        for level in sorted(self._queues):
            yield from self._queues[level]

    def remove(self, requests: list[BatchRequest]) -> None:
        gone = {id(r) for r in requests}
        for level, queue in self._queues.items():
            if any(id(r) in gone for r in queue):
                self._queues[level] = deque(r for r in queue if id(r) not in gone)

    def take_if(self, predicate: Callable[[BatchRequest], bool]) -> list[BatchRequest]:
        """Remove and return every request for which ``predicate(request)`` is true."""
        taken = [r for r in self.in_order() if predicate(r)]
        if taken:
            self.remove(taken)
        return taken

    def earliest_deadline(self) -> float | None:
        return min((r.deadline for r in self.in_order()), default=None)
