"""Which code runs each part of a model (a native kernel or torch): reported at
start-up and in the /v2 metadata. Plain data, no torch, so the engine's core can
carry it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PathTaken:
    """Which code runs one part of a model: a native kernel (``native``) or torch,
    with the kernel and its extent, or why not."""

    part: str
    native: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.part}: {'native' if self.native else 'torch'} ({self.detail})"
