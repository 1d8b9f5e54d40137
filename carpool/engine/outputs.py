"""The messages between scheduler, model runner and engine (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from carpool.engine.sequence import Sequence

# A draft of these is no guess to verify: the runner generates the tokens itself,
# each pass feeding the last's token back, before the host sees any (multi-step
# decoding, ``EngineConfig.num_scheduler_steps``).
LOOKAHEAD = -1


def pending(row: int) -> int:
    """The id standing, until its step lands, for the token sampled in ``row`` of the
    step in flight (asynchronous scheduling): the runner reads it on the device."""
    return -2 - row


class ScheduledChunk(NamedTuple):
    """Run ``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed``: its
    own next tokens, then ``draft`` (speculated tokens to verify, after its last).

    ``samples`` is true when the chunk reaches the sequence's last token, so the
    step produces its next token (and, with a draft, the draft tokens it accepts).
    A named tuple, not a frozen dataclass: one is made per sequence per step, and a
    frozen dataclass takes ~1.3 us to make against ~0.5 (issue 48)."""

    seq: Sequence
    num_tokens: int
    samples: bool
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        """A chunk of ``seq``'s next ``num_tokens`` and ``draft``, fixed at scheduling
        time (the sequence moves on; the message must not)."""
        samples = seq.num_computed + num_tokens == seq.num_tokens
        return cls(seq, num_tokens + len(draft), samples, draft)

    @property
    def lookahead(self) -> bool:
        """Whether the draft is ``LOOKAHEAD`` placeholders, not tokens to verify."""
        return self.draft[:1] == (LOOKAHEAD,)

    @property
    def input_ids(self) -> list[int]:
        """The token ids this chunk runs."""
        start = self.seq.num_computed
        own = self.num_tokens - len(self.draft)
        return [*self.seq.token_ids[start : start + own], *self.draft]


@dataclass
class SchedulerOutput:
    """One engine step: what to run, and what ended or was preempted while planning."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def has_prompt(self) -> bool:
        """Whether a chunk runs more than one token of its own (a prompt's, or a
        preempted sequence's recomputation): a step that is not decodes alone."""
        return any(c.num_tokens - len(c.draft) > 1 for c in self.chunks)
