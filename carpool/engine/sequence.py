"""A generation request as the scheduler sees it: tokens, progress, blocks, state."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum
from itertools import islice
from typing import overload

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
    """One sequence being generated: ``token_ids`` holds the prompt, then each
    generated token, in one list that only grows (no copy per step).

    ``num_computed`` counts the tokens whose KV is in the cache. A sequence is in
    prefill while more than one token is uncomputed, and decoding when exactly the
    last sampled token is. Preemption frees its blocks and sets ``num_computed`` to
    0: it is recomputed (prompt and output so far) when it runs again.

    ``num_pending`` counts tokens sampled by a step still in flight (asynchronous
    scheduling): they count in ``num_tokens`` (the sequence is planned as if they were
    known) but are not in ``token_ids`` until they land (``land``).
    """

    request_id: str
    token_ids: list[int]
    max_tokens: int
    arrival: float
    priority: int = 0
    deadline: float | None = None
    stop_token_ids: frozenset[int] = frozenset()  # EOS unless ignored, and stop_token_ids
    use_prefix_cache: bool = True  # False: every prompt token is computed (prompt logprobs)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    block_table: BlockTable = field(default_factory=BlockTable)
    num_preemptions: int = 0
    # Tokens proposed for the next step to verify (speculative decoding); the
    # scheduler takes them when it schedules the sequence.
    draft: list[int] = field(default_factory=list)
    # Forward passes the next decode step may run after its own (multi-step
    # decoding), each fed the last one's greedy token on the device.
    lookahead: int = 0
    num_pending: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)

    def extend(self, token_ids: Seq[int]) -> None:
        """Add generated tokens, in order."""
        self.token_ids.extend(token_ids)

    def land(self, token_id: int) -> None:
        """The oldest pending token is known: ``token_id``."""
        self.token_ids.append(token_id)
        self.num_pending -= 1

    @property
    def prompt_ids(self) -> list[int]:
        """A copy of the prompt's tokens."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        """A copy of the generated tokens (add some with ``extend``)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def outputs_view(self) -> OutputsView:
        """The generated tokens as they stand whenever read (no copy)."""
        return OutputsView(self.token_ids, self.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        """Its tokens, pending ones included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def order(self) -> tuple[int, float]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival)


class OutputsView(Seq[int]):
    """The tokens of ``token_ids`` from ``start`` on, read when asked: a sampling row
    sees its sequence's tokens so far without a copy made each step (issue 48)."""

    __slots__ = ("_ids", "_start")

    def __init__(self, token_ids: list[int], start: int) -> None:
        self._ids = token_ids
        self._start = start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._ids[self._start :][index]

    def __iter__(self) -> Iterator[int]:
        return islice(self._ids, self._start, None)
