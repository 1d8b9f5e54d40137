"""A generation request as the scheduler sees it: tokens, progress, blocks, state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from carpool.engine.block_manager import BlockTable


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    """Why a sequence ended (OpenAI's ``stop``/``length``, plus carpool's own)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"


@dataclass(eq=False)
class Sequence:
    """One sequence being generated.

    ``num_computed`` counts the tokens whose KV is in the cache. A sequence is in
    prefill while more than one token is uncomputed, and decoding when exactly the
    last sampled token is. Preemption frees its blocks and sets ``num_computed`` to
    0: it is recomputed (prompt and output so far) when it runs again.
    """

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float
    priority: int = 0
    deadline: float | None = None
    eos_token_id: int | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: BlockTable = field(default_factory=BlockTable)
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def order(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival)
