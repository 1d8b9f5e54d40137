"""Drafts from a small model (``{"method": "draft_model", "model": ...}``): its greedy
tokens after each sequence's tokens.

The draft model runs on an ``Engine`` of its own (its own paged KV cache, prefix
caching on), owned by the target engine and stepped on the same thread: for each
sequence to draft for, a request of its tokens for up to k greedy tokens. Full
blocks of a sequence's earlier tokens are found in the draft engine's prefix cache,
so a step computes the few tokens since that sequence's last draft, then k - 1
decodes. The draft tokens are proposals like prompt lookup's, and verified the same
way (``carpool.engine.speculative``). No torch here: ``carpool.workers.factory.engine_for``
builds the draft engine on the draft model.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from carpool.engine.engine import Engine
from carpool.engine.sampling_params import SamplingParams
from carpool.errors import CarpoolError

log = logging.getLogger(__name__)


class DraftModelProposer:
    """A ``Proposer`` over a draft model's engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    def propose(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        asked: dict[str, str] = {}  # draft request id -> sequence id
        for seq_id, tokens, k in wanted:
            if len(tokens) + k > self.engine.max_model_len:
                continue  # past the draft model's context: no draft
            request_id = f"draft-{next(self._ids)}"
            params = SamplingParams(
                max_tokens=k, temperature=0.0, ignore_eos=True, output_kind="final_only"
            )
            try:
                self.engine.add_request(request_id, tokens, params)
            except CarpoolError as exc:
                log.debug("no draft for %s: %s", seq_id, exc)
                continue
            asked[request_id] = seq_id
        drafts: dict[str, list[int]] = {}
        while self.engine.has_work:
            for out in self.engine.step():
                target = asked.get(out.request_id)
                if out.finished and target is not None and out.error is None:
                    draft = list(out.outputs[0].token_ids)
                    if draft:
                        drafts[target] = draft
        return drafts

    def forget(self, seq_id: str) -> None:
        """Nothing is kept per sequence: the draft engine's prefix cache holds its
        blocks until they are needed for others."""
