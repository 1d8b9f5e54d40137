"""A fake batch model for fault injection in batcher tests, and a fake pool of its
instances."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class EchoModel:
    """Returns each payload doubled; raises on payloads listed in ``poison``."""

    ragged = True

    def __init__(self, poison: set[int] | None = None) -> None:
        self.poison = poison or set()
        self.batches: list[list[int]] = []

    def collate(self, payloads: list[int]) -> list[int]:
        return list(payloads)

    def forward(self, batch: list[int]) -> list[int]:
        self.batches.append(batch)
        bad = self.poison.intersection(batch)
        if bad:
            raise ValueError(f"poisoned input {sorted(bad)}")
        return [2 * x for x in batch]

    def split(self, output: Any, count: int) -> list[int]:
        return list(output)


class ThreadPool:
    """A fake ``InstancePool``: ``count`` instances, each batch on a thread of its own
    running ``forward``; abandoned instances are recorded and replaced at once when
    ``replace`` (else they stay out)."""

    def __init__(self, count: int, forward: Callable[[Any], Any], timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.forward = forward
        self.free = set(range(count))
        self.abandoned: list[int] = []
        self.notify: Callable[[], None] = lambda: None

    def attach(self, notify: Callable[[], None]) -> None:
        self.notify = notify

    def has_free(self) -> bool:
        return bool(self.free)

    def take(self) -> int | None:
        if not self.free:
            return None
        index = min(self.free)
        self.free.discard(index)
        return index

    def run(self, index: int, job: Callable[[Callable[[Any], Any]], None]) -> None:
        threading.Thread(target=job, args=(self.forward,), daemon=True).start()

    def give_back(self, index: int) -> None:
        assert index not in self.free and index not in self.abandoned
        self.free.add(index)

    def abandon(self, index: int) -> None:
        self.abandoned.append(index)

    def abandon_note(self, index: int) -> str:
        return f"instance {index} is being replaced"
