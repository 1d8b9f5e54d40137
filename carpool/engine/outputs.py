"""The messages between scheduler, model runner and engine (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from carpool.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """Run ``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed``.

    ``samples`` is true when the chunk reaches the sequence's last token, so the
    step produces its next token."""

    seq: Sequence
    num_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        """A chunk of ``seq``'s next ``num_tokens``, fixed at scheduling time (the
        sequence moves on; the message must not)."""
        return cls(seq, num_tokens, seq.num_computed + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    """One engine step: what to run, and what ended or was preempted while planning."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
