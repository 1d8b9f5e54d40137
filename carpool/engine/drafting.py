"""Where a decode step's tokens beyond its one come from, chosen once per engine
(``drafter_for``): none; lookahead (multi-step decoding: the runner's own greedy
passes after the step's, fed back on the device); or speculation (a ``Speculator``'s
drafts, n-gram or draft model, which the step verifies).

Before each step the engine hands the running sequences to its drafter, which sets
each decoding one's ``draft`` or ``lookahead``; the scheduler takes them with the
sequence when the budget and free blocks allow. No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from carpool.config import EngineConfig, SpeculativeConfig
from carpool.engine.runner import Runner
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import Sequence
from carpool.engine.speculative import Proposer, Speculator

# Whether a running sequence may take drafts (its request allows them).
Wants = Callable[[Sequence], bool]
# How many tokens beyond its next one a sequence may take (its length and the model's).
Room = Callable[[Sequence], int]


def speculable(params: SamplingParams) -> bool:
    """Whether tokens may be taken more than one a step for ``params`` (drafts
    verified, lookahead passes, a step launched before the last one lands): greedy or
    plain sampling (temperature, top-k, top-p, min-p), with nothing that depends on
    each token emitted before it (penalties, min_tokens, a grammar) and no
    log-probabilities."""
    return (
        params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and not params.min_tokens
        and not params.logit_bias
        and params.grammar is None
        and params.logprobs is None
    )


class Drafter(Protocol):
    """Gives decoding sequences their drafts or lookahead before a step."""

    def allows(self, params: SamplingParams) -> bool:
        """Whether a request sampled with ``params`` may take any."""
        ...

    def draft(self, running: list[Sequence], wants: Wants, room: Room) -> None:
        """Set the ``draft`` or ``lookahead`` of each of ``running`` that is decoding
        and ``wants`` them, at most ``room`` tokens; clear the others'."""
        ...

    def accepted(self, seq_id: str, drafted: int, accepted: int) -> None:
        """``seq_id``'s step verified ``drafted`` draft tokens and kept ``accepted``."""
        ...

    def forget(self, seq_id: str) -> None:
        """``seq_id`` is retired."""
        ...


class NoDrafts:
    """One token a step."""

    def allows(self, params: SamplingParams) -> bool:
        return False

    def draft(self, running: list[Sequence], wants: Wants, room: Room) -> None:
        return None

    def accepted(self, seq_id: str, drafted: int, accepted: int) -> None:
        return None

    def forget(self, seq_id: str) -> None:
        return None


class Lookahead(NoDrafts):
    """Multi-step decoding: up to ``passes`` more forward passes a decode step for a
    greedy request."""

    def __init__(self, passes: int) -> None:
        self.passes = passes

    def allows(self, params: SamplingParams) -> bool:
        return params.greedy and speculable(params)

    def draft(self, running: list[Sequence], wants: Wants, room: Room) -> None:
        for seq in running:
            decoding = seq.num_uncomputed == 1 and wants(seq)
            seq.lookahead = max(0, min(self.passes, room(seq))) if decoding else 0


class Speculation:
    """Speculative decoding: a ``Speculator``'s drafts, verified by the step."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator

    def allows(self, params: SamplingParams) -> bool:
        return speculable(params)

    def draft(self, running: list[Sequence], wants: Wants, room: Room) -> None:
        for seq in running:
            seq.draft = []  # a draft not scheduled last step is not carried over
        if not self.speculator.drafting(len(running)):
            return
        decoding = {s.request_id: s for s in running if s.num_uncomputed == 1 and wants(s)}
        limits = [(rid, s.token_ids, room(s)) for rid, s in decoding.items()]
        for rid, draft in self.speculator.drafts(limits).items():
            decoding[rid].draft = draft

    def accepted(self, seq_id: str, drafted: int, accepted: int) -> None:
        self.speculator.accepted(seq_id, drafted, accepted)

    def forget(self, seq_id: str) -> None:
        self.speculator.forget(seq_id)


def drafter_for(config: EngineConfig, runner: Runner, proposer: Proposer | None) -> Drafter:
    """The drafter ``config`` asks for: speculation with ``speculative_config``
    (``proposer``: where a draft model's drafts come from), lookahead with
    ``num_scheduler_steps`` > 1 where the runner can (``Runner.multi_step``), else
    none."""
    if config.speculative_config:
        return Speculation(Speculator(SpeculativeConfig.parse(config.speculative_config), proposer))
    if runner.multi_step and config.num_scheduler_steps > 1:
        return Lookahead(config.num_scheduler_steps - 1)
    return NoDrafts()
