"""What a generation engine reports, after vLLM v1's output processor: each request's
state beside its sequences (its outputs so far, detokenizers, sampling rows with their
grammars, timings), each token emitted into it (the grammar advanced, stop tokens and
stop strings found, text detokenized), and each step's outputs built from it: every
request a step touched is reported, and a finished one retired into the engine's
statistics. No torch; the engine's thread alone calls it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from carpool.clock import Clock
from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import SamplingRow, TokenLogprobs
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.sequence import FinishReason, Sequence, SequenceStatus
from carpool.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineRequest:
    """A request's sequences and what the engine tracks for them."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    arrival: float
    seqs: list[Sequence]
    rows: list[SamplingRow]
    detoks: list[IncrementalDetokenizer]
    outputs: list[CompletionOutput]
    first_token_at: float | None = None
    last_token_at: float | None = None
    started_at: float | None = None
    error: str | None = None
    touched: bool = False
    num_cached_tokens: int = 0
    drafts: bool = False  # it may take drafts or lookahead (the engine's drafter allows)
    overlap: bool = False  # its steps may be launched before the last one lands
    # With params.prompt_logprobs: one entry per prompt token, the first None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        if len(self.seqs) == 1:  # most requests; read per request per step
            return self.seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


class OutputProcessor:
    """The requests an engine holds, by id and by sequence id, and what is reported
    about them. ``finish`` ends a sequence in the scheduler (a stop string or a
    grammar's end found here); ``forget`` is told each sequence id retired."""

    def __init__(
        self,
        eos_token_ids: frozenset[int],
        stats: EngineStats,
        clock: Clock,
        finish: Callable[[Sequence, FinishReason], None],
        forget: Callable[[str], None],
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.clock = clock
        self._finish = finish
        self._forget = forget
        self.requests: dict[str, EngineRequest] = {}
        self.by_seq: dict[str, tuple[EngineRequest, int]] = {}

    def add(self, req: EngineRequest) -> None:
        """Hold ``req`` (built whole: nothing of a request that failed to build is held)."""
        for i, seq in enumerate(req.seqs):
            self.by_seq[seq.request_id] = (req, i)
        self.requests[req.request_id] = req

    def fail(self, seq: Sequence, message: str) -> None:
        """End ``seq``'s request with the error ``message``: each of its sequences."""
        req, _ = self.by_seq[seq.request_id]
        req.error = message
        req.touched = True
        for other in req.seqs:
            if other.status is not SequenceStatus.FINISHED:
                self._finish(other, FinishReason.ABORT)

    def reset(self, message: str) -> list[RequestOutput]:
        """End every request with the error ``message`` (each sequence finished) and
        hold none; each request's final output."""
        for req in self.requests.values():
            req.error = req.error or message
            for seq in req.seqs:
                self._finish(seq, FinishReason.ABORT)
        finals = [
            RequestOutput(r.request_id, r.prompt_ids, [], finished=True, error=r.error)
            for r in self.requests.values()
        ]
        self.requests.clear()
        self.by_seq.clear()
        return finals

    def started(self, plan: SchedulerOutput, now: float) -> None:
        """After ``plan``'s update: touch each chunk's request; note when a request
        first ran and how much of its prompt the prefix cache held."""
        for chunk in plan.chunks:
            found = self.by_seq.get(chunk.seq.request_id)
            if found is None:  # reported finished since it was planned (overlap)
                continue
            req = found[0]
            req.touched = True
            if req.started_at is None:
                req.started_at = now
                req.num_cached_tokens = chunk.seq.num_computed - chunk.num_tokens
                with self.stats.update() as s:
                    s.prompt_tokens += len(req.prompt_ids)

    def emit(
        self, req: EngineRequest, i: int, token: int, logprobs: TokenLogprobs | None, now: float
    ) -> None:
        """Add ``token`` to ``req``'s ``i``-th output, landed at ``now``: grammar,
        stop token, text and stop strings."""
        seq, out, detok = req.seqs[i], req.outputs[i], req.detoks[i]
        out.new_token_ids.append(token)
        out.token_ids.append(token)
        constraint = req.rows[i].constraint
        if constraint is not None:
            if not constraint.accept(token):
                raise RuntimeError(f"the grammar refused the sampled token {token}")
            if constraint.finished and seq.finish_reason is None:
                self._finish(seq, FinishReason.STOP)  # complete: nothing may follow
        if logprobs is not None:
            out.new_logprobs.append(logprobs)
            out.logprobs.append(logprobs)
        if token in seq.stop_token_ids and seq.finish_reason is FinishReason.STOP:
            out.stop_reason = None if token in self.eos_token_ids else token
        else:
            out.new_text += detok.push(token)
            if detok.stopped_on is not None:
                out.stop_reason = detok.stopped_on
                self._finish(seq, FinishReason.STOP)
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now

    def collect(self) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        for req in list(self.requests.values()):
            if not req.touched:
                continue
            req.touched = False
            if req.params.output_kind == "final_only" and not req.finished:
                continue  # its new pieces gather until the last output
            try:
                output = self._report(req)
            except Exception:
                log.exception("reporting %s failed", req.request_id)
                self.fail(req.seqs[0], "detokenizing this request's output failed")
                output = RequestOutput(
                    req.request_id, req.prompt_ids, [], finished=True, error=req.error
                )
            results.append(output)
            if output.finished:
                self._retire(req)
        return results

    def _report(self, req: EngineRequest) -> RequestOutput:
        """What ``req`` has to say after this step; its pieces of new text reset."""
        finished, delta = req.finished, req.params.output_kind == "delta"
        if len(req.seqs) == 1:  # most requests: no zip, no comprehension
            outputs = [hand_over(req.seqs[0], req.outputs[0], req.detoks[0], delta)]
        else:
            outputs = [
                hand_over(seq, out, detok, delta)
                for seq, out, detok in zip(req.seqs, req.outputs, req.detoks, strict=True)
            ]
        return RequestOutput(
            req.request_id,
            req.prompt_ids,
            outputs,
            finished=finished,
            error=req.error,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=(
                list(req.prompt_logprobs)
                if req.prompt_logprobs is not None and (finished or req.first_token_at)
                else None
            ),
        )

    def _retire(self, req: EngineRequest) -> None:
        del self.requests[req.request_id]
        for seq in req.seqs:
            del self.by_seq[seq.request_id]
            self._forget(seq.request_id)
        now = self.clock.now()
        with self.stats.update() as s:
            for seq in req.seqs:
                reason = "error" if req.error else seq.finish_reason.value  # type: ignore[union-attr]
                s.finished[reason] = s.finished.get(reason, 0) + 1
            s.e2e_latency.observe(now - req.arrival)
            if req.started_at is not None:
                s.queue_time.observe(req.started_at - req.arrival)
            if req.first_token_at is not None:
                s.time_to_first_token.observe(req.first_token_at - req.arrival)
                tokens = max(len(o.token_ids) for o in req.outputs)
                if tokens > 1 and req.last_token_at is not None:
                    itl = (req.last_token_at - req.first_token_at) / (tokens - 1)
                    s.inter_token_latency.observe(itl)


def hand_over(
    seq: Sequence, out: CompletionOutput, detok: IncrementalDetokenizer, delta: bool
) -> CompletionOutput:
    """``out`` as it stands after this step (the text held for a stop string flushed
    once ``seq`` has ended), or with ``delta`` its new pieces alone; its new pieces go
    with it and start again empty."""
    if seq.finish_reason is not None and out.finish_reason is None:
        out.new_text += detok.flush()
        out.finish_reason = seq.finish_reason
    if delta:
        text, token_ids, logprobs = out.new_text, out.new_token_ids, out.new_logprobs
    else:
        out.text += out.new_text
        text, token_ids, logprobs = out.text, list(out.token_ids), list(out.logprobs)
    snapshot = CompletionOutput(
        out.index,
        text,
        token_ids,
        logprobs,
        out.new_text,
        out.new_token_ids,
        out.new_logprobs,
        out.finish_reason,
        out.stop_reason,
    )
    out.new_text, out.new_token_ids, out.new_logprobs = "", [], []
    return snapshot
