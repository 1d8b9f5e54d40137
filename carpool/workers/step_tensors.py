"""What the runners share about a step's tensors: the inputs laid out for one forward
pass, a launched step's chosen tokens, and the placeholder ids of asynchronous
scheduling (checked on the host, resolved on the device)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from carpool.engine.outputs import ScheduledChunk
from carpool.engine.runner import Launch
from carpool.models.attention import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor  # rows of the hidden states that produce logits
    sampling_chunks: list[ScheduledChunk]
    chunk_starts: list[int]  # each chunk's first row, in step.chunks order


@dataclass(frozen=True)
class Chosen:
    """A launched step's tokens: on the device (what the next step's pending ids
    read), their copy for the host, and on a GPU the events around the step."""

    tokens: torch.Tensor
    host: torch.Tensor
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None


def pending_tokens(after: Launch | None) -> torch.Tensor | None:
    """The device tokens a step's pending ids refer to (those of ``after``)."""
    return None if after is None else cast(Chosen, after.handle).tokens


def pending_id(chunk: ScheduledChunk, after: Launch | None) -> int:
    """The id standing, in a step's ids until ``resolve_pending`` replaces it on the
    device, for ``chunk``'s pending token: ``-2 - row``, its row of ``after``'s
    tokens. Raises ValueError if ``after`` sampled no token for it."""
    row = None if after is None else after.rows.get(chunk.seq.request_id)
    if row is None:
        raise ValueError("a pending token with no step in flight that samples it")
    return -2 - row


def chunk_ids(chunk: ScheduledChunk, after: Launch | None) -> list[int]:
    """``chunk``'s input ids, its pending token (if any) as its ``pending_id``."""
    ids = chunk.input_ids
    if chunk.pending:
        ids.insert(chunk.num_own - 1, pending_id(chunk, after))
    return ids


def first_ids(chunks: Sequence[ScheduledChunk], after: Launch | None) -> list[int]:
    """The input id of each chunk of one own token (a decode step's rows), a pending
    one as its ``pending_id``: every id valid for the model, so none needs
    ``check_ids``. Raises ValueError as ``pending_id`` does. Per step and sequence on a
    GPU's hot path: ``ScheduledChunk.pending``'s test (the position past the known
    tokens) made without the chunk's properties."""
    ids = []
    for chunk in chunks:
        token_ids, at = chunk.seq.token_ids, chunk.seq.num_computed
        ids.append(token_ids[at] if at < len(token_ids) else pending_id(chunk, after))
    return ids


def resolve_pending(ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """Put, in place and on the device, row r of ``tokens`` wherever ``ids`` holds
    ``-2 - r`` (``pending_id``; ``check_ids`` has seen every such r < len(tokens))."""
    if len(tokens) == 0:
        return
    refs = (-2 - ids).clamp(0, len(tokens) - 1)
    ids.copy_(torch.where(ids <= -2, tokens[refs], ids))


def check_ids(ids: list[int], after: Launch | None) -> None:
    """Refuse, as an exception of this step, an id the model may not see: a negative
    one that is not the ``pending_id`` of a row of ``after``. On a GPU it would be a
    device-side assert that ends the process."""
    if min(ids, default=0) >= 0:
        return
    rows = 0 if after is None else len(after.rows)
    if any(t < 0 and not 0 <= -2 - t < rows for t in ids):
        raise ValueError("a placeholder token id reached the model")
