"""The continuous-batching scheduler (after vLLM v1): which tokens run in the next step.

Each step has a token budget (``max_num_batched_tokens``) and a sequence limit
(``max_num_seqs``). Running sequences go first, decodes and unfinished prompt
chunks alike, so a long prompt is prefilled in chunks and never stalls the
streams already decoding; waiting sequences then fill what budget is left, in
priority then arrival order. When the KV blocks run out, the running sequence
that sorts last (lowest priority, most recently arrived) is preempted: its blocks
are freed and it goes back to the head of the waiting queue to be recomputed.
Where the model attends a sliding window, each step releases the blocks that have
fallen behind it (``BlockManager.release_behind``; a hybrid model's, in the pool of
its windowed layers: ``HybridBlockManager``), planned steps included: a block
released then is written only by a step planned later, which runs after them.
A sequence still waiting to start when a step passes it by after its deadline is
finished with a timeout (one that starts has met its deadline); ``abort``
finishes a sequence and frees its blocks at the next ``schedule``.

No torch and no threads: the engine calls ``schedule`` and ``update`` on its own
thread and feeds the sampled tokens back.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Mapping
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass

from carpool.engine.block_manager import NO_PREFIX, Blocks
from carpool.engine.outputs import ScheduledChunk, SchedulerOutput
from carpool.engine.sequence import FinishReason, Sequence, SequenceStatus


def _order(seq: Sequence) -> tuple[int, float]:
    return seq.order


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: Blocks) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in scheduling order (``Sequence.order``)
        self._aborts: set[str] = set()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=_order)

    def abort(self, request_id: str) -> None:
        """Finish ``request_id`` at the next ``schedule`` (a no-op if it has ended)."""
        self._aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._finish_aborted(out)
        budget = self.config.max_num_batched_tokens
        for seq in tuple(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            if seq.draft or seq.lookahead:
                chunk = self._take_draft(seq, budget)
                if chunk is not None:
                    out.chunks.append(chunk)
                    budget -= chunk.num_tokens
                    continue
            if self._grow_or_preempt(seq, n, out):
                out.chunks.append(ScheduledChunk.of(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # Waiting sequences hold no blocks (preemption frees them): start from
            # whatever full-block prefix is cached.
            prefix = self.blocks.match_prefix(seq.token_ids) if seq.use_prefix_cache else NO_PREFIX
            cached = len(prefix) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.allocate(seq.block_table, cached + n, prefix):
                break
            if seq.use_prefix_cache:
                self.blocks.record_prefix(seq.token_ids, prefix)
            seq.num_computed = cached
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            seq.deadline = None  # it has started: a later preemption does not expire it
            insort(self.running, seq, key=_order)
            out.chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        # After admission: a deadline expires only a request this opportunity to start
        # passed by, so one that finds the engine idle starts however short its timeout.
        self._expire_waiting(now, out)
        return out

    def _take_draft(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        """A decoding sequence's chunk with its draft (or lookahead), as much of it as
        the budget and free blocks allow (a draft never preempts anybody); None when
        nothing of it fits: the sequence is then scheduled without."""
        draft, seq.draft = tuple(seq.draft[: budget - 1]), []
        lookahead, seq.lookahead = min(seq.lookahead, budget - 1), 0
        if seq.num_uncomputed != 1 or not (draft or lookahead):
            return None
        if not self.blocks.allocate(seq.block_table, seq.num_tokens + len(draft) + lookahead):
            return None
        return ScheduledChunk.of(seq, 1, draft, lookahead)

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, Sequence_[int]] | None
    ) -> list[Sequence]:
        """Record a step's results: advance each chunk, append each sampling chunk's
        tokens (its accepted draft tokens, then the one sampled), finish what hit a
        stop or length (dropping any tokens after it). ``sampled`` None: the step is
        in flight, and each sampling chunk's token is pending until ``land``. Returns
        the sequences finished now."""
        finished: list[Sequence] = []
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            own = chunk.num_own
            if not chunk.samples:
                self._computed(seq, seq.num_computed + own)
                continue
            if sampled is None:
                # Its token is in flight: one pending (a length ends it now; a stop
                # token when it lands).
                seq.num_pending += 1
                self._computed(seq, seq.num_computed + own)
                if seq.num_output_tokens >= seq.max_tokens:
                    self._finish(seq, FinishReason.LENGTH)
                    finished.append(seq)
                continue
            new = sampled[seq.request_id]
            tokens = self._until_end(seq, new)
            computed = seq.num_computed + own + len(new) - 1
            seq.extend(tokens)
            # The draft tokens accepted have their KV in the cache; the last token
            # appended never has.
            self._computed(seq, min(computed, seq.num_tokens - 1))
            if tokens[-1] in seq.stop_token_ids:
                self._finish(seq, FinishReason.STOP)
            elif seq.num_output_tokens >= seq.max_tokens:
                self._finish(seq, FinishReason.LENGTH)
            if seq.status is SequenceStatus.FINISHED:
                finished.append(seq)
        return finished

    def _computed(self, seq: Sequence, num_computed: int) -> None:
        """``seq``'s KV is in the cache up to ``num_computed``: its full blocks are
        committed (for prefix reuse), those behind its window freed."""
        seq.num_computed = num_computed
        self.blocks.commit(seq.block_table, seq.token_ids, num_computed)
        self.blocks.release_behind(seq.block_table, num_computed)

    @staticmethod
    def _until_end(seq: Sequence, tokens: Sequence_[int]) -> Sequence_[int]:
        """``tokens`` up to the first that ends ``seq`` (a stop token or its length)."""
        if len(tokens) == 1:
            return tokens  # a plain step's: whatever it is, it is kept
        room = seq.max_tokens - seq.num_output_tokens
        for j, token in enumerate(tokens):
            if token in seq.stop_token_ids or j + 1 >= room:
                return tokens[: j + 1]
        return tokens

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` now (a stop string matched by the detokenizer, say)."""
        self._finish(seq, reason)

    def land(self, seq: Sequence, token: int) -> None:
        """``seq``'s pending token is ``token`` (sampled by a step the host ran ahead
        of: asynchronous scheduling); a stop token ends ``seq`` as ``update`` would
        have, STOP even over the length that ended it when the step was planned."""
        seq.land(token)
        if token not in seq.stop_token_ids:
            return
        if seq.finish_reason is FinishReason.LENGTH:
            seq.finish_reason = FinishReason.STOP
        elif seq.status is not SequenceStatus.FINISHED:
            self._finish(seq, FinishReason.STOP)

    def _grow_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Give ``seq`` room for ``n`` more tokens, preempting the last-ordered running
        sequences while blocks are short. False if ``seq`` itself was preempted."""
        while not self.blocks.allocate(seq.block_table, seq.num_computed + n):
            victim = max(
                (s for s in self.running if s.status is SequenceStatus.RUNNING),
                key=lambda s: s.order,
            )
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.draft = []
        seq.lookahead = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        out.chunks[:] = [c for c in out.chunks if c.seq is not seq]
        self.add(seq)
        out.preempted.append(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _finish_aborted(self, out: SchedulerOutput) -> None:
        if not self._aborts:
            return
        for seq in [*self.running, *self.waiting]:
            if seq.request_id in self._aborts:
                self._finish(seq, FinishReason.ABORT)
                out.finished.append(seq)
        self._aborts.clear()

    def _expire_waiting(self, now: float, out: SchedulerOutput) -> None:
        for seq in [s for s in self.waiting if s.deadline is not None and s.deadline <= now]:
            self._finish(seq, FinishReason.TIMEOUT)
            out.finished.append(seq)

    def check(self, everything: list[Sequence]) -> None:
        """Invariants: each sequence in exactly one state and list; only running ones
        hold blocks; the block manager agrees with the running tables."""
        for seq in everything:
            places = (
                (seq in self.waiting)
                + (seq in self.running)
                + (seq.status is SequenceStatus.FINISHED)
            )
            assert places == 1, f"{seq.request_id} is in {places} places"
            assert (seq in self.running) == (seq.status is SequenceStatus.RUNNING)
            if seq.status is not SequenceStatus.RUNNING:
                assert not seq.block_table.blocks, (
                    f"{seq.request_id} holds blocks while not running"
                )
        assert len(self.running) <= self.config.max_num_seqs
        self.blocks.check([s.block_table for s in self.running])
