"""A fake batch model for fault injection in batcher tests."""

from __future__ import annotations

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
