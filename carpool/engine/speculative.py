"""Speculative decoding: drafts, and when to make them.

Before each step the engine asks ``Speculator.drafts`` for the decoding sequences'
drafts of up to ``num_speculative_tokens`` tokens, from a ``Proposer``: prompt lookup
(``ngram``: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, in its
prompt or its own output) or a small draft model's greedy tokens (``draft_model``:
``carpool.engine.draft_model``, built by ``carpool.workers.factory.engine_for``). Either way a
draft is a proposal of fixed tokens, so verifying it as below keeps the target
model's distribution. The model then runs the
last token and the draft as one chunk and the sampler keeps the longest prefix
the target model agrees with (greedy: equal argmax; sampled: rejection sampling),
plus one token of its own, so a step yields 1 to k+1 tokens.

Adaptive: no drafts in a step with more than ``disable_by_batch_size`` running
sequences (a large batch is compute-bound: extra rows cost what they would save);
a sequence drafts about one token more than it has lately had accepted per draft
(each verified row costs a share of a step on this CPU); a sequence whose drafts
are mostly rejected (acceptance below
``min_acceptance``, averaged over its recent drafts) stops drafting for a
cool-down that doubles each time, then tries again.

No torch: plain lists; the engine owns one ``Speculator``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from carpool.config import SpeculativeConfig


class Proposer(Protocol):
    """Where drafts come from."""

    def propose(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """``wanted``: (sequence id, its tokens, most tokens to draft, >= 1) for each
        sequence to draft for; each draft found, by sequence id (1 to that many
        tokens; a sequence without one left out)."""
        ...

    def forget(self, seq_id: str) -> None:
        """``seq_id`` finished (or restarts from scratch)."""
        ...


class NgramIndex:
    """For each n, the position just after the latest occurrence of every n-gram
    that ends before a sequence's last token; extended as the sequence grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending before this position are in

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the
        longest tail n-gram found; [] when none recurs."""
        last = len(tokens) - 1
        for end in range(self._indexed, last):
            for n in self.sizes:
                if end + 1 >= n:
                    self._after[n][tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self._indexed = max(self._indexed, last)
        for n in self.sizes:
            if len(tokens) > n:
                at = self._after[n].get(tuple(tokens[len(tokens) - n :]))
                if at is not None:
                    return list(tokens[at : at + k])
        return []


class NgramProposer:
    """Prompt lookup: an ``NgramIndex`` per sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for seq_id, tokens, k in wanted:
            index = self._indexes.get(seq_id)
            if index is None:
                index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
            draft = index.propose(tokens, k)
            if draft:
                out[seq_id] = draft
        return out

    def forget(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)


@dataclass
class DraftState:
    """One sequence's drafting history."""

    run: float  # tokens accepted per draft, recent drafts averaged
    acceptance: float = 1.0  # recent drafts' accepted fraction, averaged
    paused_until: int = 0  # step number
    pause: int = 8  # steps of the next pause


class Speculator:
    """Drafts for a step's decoding sequences, and what was accepted of them."""

    # Weight of the newest draft in a sequence's running acceptance.
    SMOOTHING = 0.3

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """``proposer``: where drafts come from; prompt lookup when None (a
        ``draft_model`` config needs its proposer handed in)."""
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"speculative method {config.method} needs its proposer")
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.config = config
        self.proposer = proposer
        self._states: dict[str, DraftState] = {}
        self._step = 0

    def drafting(self, running: int) -> bool:
        """Whether a step with ``running`` sequences drafts at all (a step counts
        towards the pauses either way)."""
        self._step += 1
        return running <= self.config.disable_by_batch_size

    def drafts(self, decoding: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """``decoding``: (sequence id, its tokens, most tokens its draft may have)
        for each sequence whose next step is a decode, in a step that ``drafting``
        allowed. The drafts to verify, by sequence id (sequences without one left
        out)."""
        c = self.config
        wanted: list[tuple[str, Sequence[int], int]] = []
        for seq_id, tokens, room in decoding:
            state = self._states.get(seq_id)
            if state is None:
                state = self._states[seq_id] = DraftState(run=float(c.num_speculative_tokens))
            if room < 1 or self._step < state.paused_until:
                continue
            # Each draft row costs a share of a step: draft about one token more than
            # this sequence has lately had accepted.
            length = max(1, math.ceil(state.run) + 1)
            wanted.append((seq_id, tokens, min(c.num_speculative_tokens, room, length)))
        return self.proposer.propose(wanted) if wanted else {}

    def accepted(self, seq_id: str, proposed: int, accepted: int) -> None:
        """Record how much of ``seq_id``'s draft the model accepted; pause its
        drafting if its acceptance has fallen below the bar."""
        state = self._states.get(seq_id)
        if state is None or proposed == 0:
            return
        state.acceptance += self.SMOOTHING * (accepted / proposed - state.acceptance)
        state.run += self.SMOOTHING * (accepted - state.run)
        if state.acceptance < self.config.min_acceptance:
            state.paused_until = self._step + state.pause
            state.pause *= 2
            state.acceptance = self.config.min_acceptance  # one more chance after the pause

    def forget(self, seq_id: str) -> None:
        """``seq_id`` finished (or restarts from scratch after preemption)."""
        self._states.pop(seq_id, None)
        self.proposer.forget(seq_id)
