"""The messages between scheduler, model runner and engine (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from carpool.engine.sequence import Sequence


class ScheduledChunk(NamedTuple):
    """Run ``num_tokens`` tokens of ``seq`` starting at ``seq.num_computed``: its
    own next tokens, then ``draft`` (speculated tokens to verify, after its last),
    then ``lookahead`` more passes (multi-step decoding: each fed the last pass's
    greedy token on the device).

    ``samples`` is true when the chunk reaches the sequence's last token, so the
    step produces its next token (and, with a draft, the draft tokens it accepts;
    with lookahead, the tokens of the later passes).
    A named tuple, not a frozen dataclass: one is made per sequence per step, and a
    frozen dataclass takes ~1.3 us to make against ~0.5 (issue 48)."""

    seq: Sequence
    num_tokens: int
    samples: bool
    draft: tuple[int, ...] = ()
    lookahead: int = 0

    @classmethod
    def of(
        cls, seq: Sequence, num_tokens: int, draft: tuple[int, ...] = (), lookahead: int = 0
    ) -> ScheduledChunk:
        """A chunk of ``seq``'s next ``num_tokens`` and ``draft`` or ``lookahead``,
        fixed at scheduling time (the sequence moves on; the message must not)."""
        samples = seq.num_computed + num_tokens == seq.num_tokens
        return cls(seq, num_tokens + len(draft) + lookahead, samples, draft, lookahead)

    @property
    def num_own(self) -> int:
        """The sequence's own tokens this chunk runs (no draft, no lookahead)."""
        return self.num_tokens - len(self.draft) - self.lookahead

    @property
    def pending(self) -> bool:
        """Whether its last own token is still in flight (sampled by the step before,
        not landed: asynchronous scheduling), which is when its position is past the
        known tokens: ``input_ids`` lacks it and the runner reads it on the device."""
        seq = self.seq
        return seq.num_computed + self.num_own > len(seq.token_ids)

    @property
    def input_ids(self) -> list[int]:
        """The known token ids this chunk runs: its own (less the last if ``pending``),
        then its draft."""
        start = self.seq.num_computed
        own = self.seq.token_ids[start : start + self.num_own]
        return [*own, *self.draft] if self.draft else own


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
        return any(c.num_own > 1 for c in self.chunks)
