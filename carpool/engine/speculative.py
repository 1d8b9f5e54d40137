"""Prompt-lookup (n-gram) speculative decoding: drafts, and when to make them.

Before each step the engine asks ``Speculator.drafts`` for the decoding sequences'
drafts: up to ``num_speculative_tokens`` tokens that followed the latest earlier
occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``), in its prompt or its own output. The model then runs the
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

from carpool.config import _help, _require, from_json


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` (vLLM's name; JSON), e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}``."""

    method: str = _help("Drafting method: ngram (prompt lookup, no extra model).", default="ngram")
    num_speculative_tokens: int = _help("Most tokens drafted per step.", default=4)
    prompt_lookup_max: int = _help("Longest n-gram looked up.", default=4)
    prompt_lookup_min: int = _help("Shortest n-gram looked up.", default=2)
    disable_by_batch_size: int = _help(
        "No drafts in a step with more running sequences than this.", default=4
    )
    min_acceptance: float = _help(
        "A sequence whose recent drafts are accepted less than this (0 to 1) pauses "
        "drafting for a while.",
        default=0.3,
    )

    def __post_init__(self) -> None:
        _require(self.method == "ngram", f"method must be ngram, got {self.method!r}")
        _require(1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens in [1, 16]")
        _require(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16,
            "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16",
        )
        _require(self.disable_by_batch_size >= 1, "disable_by_batch_size must be >= 1")
        _require(0.0 <= self.min_acceptance <= 1.0, "min_acceptance must be in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON text; raises ``ConfigError``."""
        return from_json(cls, text, "speculative_config")


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


@dataclass
class DraftState:
    """One sequence's drafting history."""

    index: NgramIndex
    run: float  # tokens accepted per draft, recent drafts averaged
    acceptance: float = 1.0  # recent drafts' accepted fraction, averaged
    paused_until: int = 0  # step number
    pause: int = 8  # steps of the next pause


class Speculator:
    """Drafts for a step's decoding sequences, and what was accepted of them."""

    # Weight of the newest draft in a sequence's running acceptance.
    SMOOTHING = 0.3

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
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
        out: dict[str, list[int]] = {}
        for seq_id, tokens, room in decoding:
            state = self._states.get(seq_id)
            if state is None:
                index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)
                state = DraftState(index, run=float(c.num_speculative_tokens))
                self._states[seq_id] = state
            if room < 1 or self._step < state.paused_until:
                continue
            # Each draft row costs a share of a step: draft about one token more than
            # this sequence has lately had accepted.
            wanted = max(1, math.ceil(state.run) + 1)
            draft = state.index.propose(tokens, min(c.num_speculative_tokens, room, wanted))
            if draft:
                out[seq_id] = draft
        return out

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
