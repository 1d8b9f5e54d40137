"""The generation engine: requests in, one step at a time, outputs out.

``step`` reads as three verbs over plain data: the scheduler plans the step, the
model runner runs it and samples, and ``_postprocess`` feeds the tokens back to the
scheduler and hands each to the output processor (``output_processor``: requests'
state, detokenizing, stop strings, grammars, reports). With asynchronous scheduling
the middle verb splits in two: step N + 1 is launched, then step N lands and is
reported while the device runs N + 1 (``_overlapped``). Single-threaded: the device
runtime's thread calls ``add_request``, ``abort`` and ``step`` (``AsyncEngine`` posts
them there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from carpool.clock import Clock, MonotonicClock
from carpool.config import EngineConfig, SpeculativeConfig
from carpool.engine.block_manager import BlockManager, Blocks, HybridBlockManager
from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.engine.output_processor import EngineRequest, OutputProcessor
from carpool.engine.outputs import LOOKAHEAD, SchedulerOutput, pending
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import (
    Launch,
    LaunchingRunner,
    Runner,
    Sampled,
    SamplingRow,
    StepResult,
)
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import Scheduler, SchedulerConfig
from carpool.engine.sequence import FinishReason, Sequence, SequenceStatus
from carpool.engine.speculative import Proposer, Speculator
from carpool.errors import InvalidRequest
from carpool.stats import EngineStats

if TYPE_CHECKING:
    from carpool.paths import PathTaken

log = logging.getLogger(__name__)


@dataclass
class _Flight:
    """A step launched and not landed: its plan, the runner's launch, and where each
    sampling sequence's ``pending`` token sits in its ``token_ids``."""

    plan: SchedulerOutput
    launch: Launch
    at: dict[str, int]


class Engine:
    """Request bookkeeping over a ``Runner`` it is handed (``engine_for`` in
    ``carpool.workers.factory`` builds one on a torch model): nothing here imports
    torch."""

    def __init__(
        self,
        runner: Runner,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``proposer``: where speculative drafts come from, for a
        ``speculative_config`` whose method needs one (``draft_model``)."""
        self.runner = runner
        self.spec = runner.spec
        # Resolved for the runner's device (``engine_for`` hands it resolved already).
        self.config = (config or EngineConfig()).for_device(runner.device_type)
        self.clock = clock or MonotonicClock()
        self.blocks = self._blocks(runner)
        budget = self.config.max_num_batched_tokens
        self.max_model_len = self.config.model_len(
            self.spec.max_position_embeddings, self._kv_tokens_per_sequence(budget)
        )
        self.scheduler = Scheduler(SchedulerConfig(budget, self.config.max_num_seqs), self.blocks)
        self.stats = EngineStats()
        spec = self.config.speculative_config
        self.speculator = Speculator(SpeculativeConfig.parse(spec), proposer) if spec else None
        # Multi-step decoding, where the runner can (``Runner.multi_step``) and no
        # speculation claims the drafts.
        steps = self.config.num_scheduler_steps
        multi = runner.multi_step and self.speculator is None
        self.lookahead = steps - 1 if multi else 0
        # Asynchronous scheduling, where the runner launches steps; the config refuses
        # it beside speculation and multi-step decoding.
        launches = bool(self.config.async_scheduling) and isinstance(runner, LaunchingRunner)
        self._launcher = runner if launches else None
        self._flight: _Flight | None = None
        self.outputs = OutputProcessor(
            self.spec.eos_token_ids, self.stats, self.clock, self.scheduler.finish, self._forget
        )

    def _blocks(self, runner: Runner) -> Blocks:
        """One pool, or a hybrid model's two (its runner keeps the KV so)."""
        size, caching = self.config.block_size, self.config.enable_prefix_caching
        full = BlockManager(runner.num_blocks, size, caching, window=self.spec.sliding_window)
        if self.spec.hybrid_window is None:
            return full
        windowed = BlockManager(
            self.spec.window_blocks, size, caching, window=self.spec.hybrid_window
        )
        return HybridBlockManager(full, windowed)

    def _kv_tokens_per_sequence(self, budget: int) -> int:
        """The longest sequence the KV cache can run alone."""
        return min(self.blocks.max_sequence_tokens(budget), self.spec.max_position_embeddings)

    @property
    def paths(self) -> tuple[PathTaken, ...]:
        """Which code runs each part of a step (native kernels or torch)."""
        return self.runner.paths

    # -- requests -----------------------------------------------------------------

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> list[int]:
        """Validate a request before anything runs; return its (maybe truncated)
        prompt. Raises ``InvalidRequest`` naming what is wrong."""
        return check_request(prompt_ids, params, self.max_model_len, self.spec.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        priority: int = 0,
        deadline: float | None = None,
        arrival: float | None = None,
    ) -> None:
        """Queue a request (``check_request`` first). ``deadline``: the time by which
        it must have started, else it ends with ``FinishReason.TIMEOUT``.

        Raises ``InvalidRequest`` for a bad request, or whatever its setup (seeding a
        generator, a detokenizer) raised; either way nothing of it is left queued."""
        if request_id in self.outputs.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        prompt = self.check_request(prompt_ids, params)
        arrival = self.clock.now() if arrival is None else arrival
        req = self._new_request(request_id, prompt, params, priority, deadline, arrival)
        # Registered only once every part of it is built.
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.outputs.add(req)

    def _new_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int,
        deadline: float | None,
        arrival: float,
    ) -> EngineRequest:
        ends = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.spec.eos_token_ids
        )
        req = EngineRequest(request_id, params, prompt, arrival, [], [], [], [])
        req.speculate = self.speculator is not None and speculable(params)
        req.lookahead = self.lookahead > 0 and params.greedy and speculable(params)
        req.overlap = self._launcher is not None and speculable(params)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt)
        for i in range(params.n):
            seq = Sequence(
                f"{request_id}#{i}",
                prompt,
                params.max_tokens,
                arrival,
                priority=priority,
                deadline=deadline,
                stop_token_ids=ends,
                use_prefix_cache=params.prompt_logprobs is None,
            )
            seed = None if params.seed is None else params.seed + i
            generator = None if seed is None else self.runner.make_generator(seed)
            req.seqs.append(seq)
            constraint = (
                None if params.grammar is None else self.runner.make_constraint(params.grammar)
            )
            req.rows.append(
                SamplingRow(params, seq.prompt_ids, seq.outputs_view, ends, generator, constraint)
            )
            req.detoks.append(
                IncrementalDetokenizer(
                    self.spec.tokenizer, prompt, params.stop, params.skip_special_tokens
                )
            )
            req.outputs.append(CompletionOutput(i))
        return req

    def abort(self, request_id: str) -> None:
        """End ``request_id`` at the next step, freeing its blocks."""
        req = self.outputs.requests.get(request_id)
        if req is not None:
            for seq in req.seqs:
                self.scheduler.abort(seq.request_id)

    def reset(self, message: str) -> list[RequestOutput]:
        """End every request with the error ``message`` and free its blocks: the
        engine's state can no longer be trusted (a step raised out of ``step``).
        Returns each request's final output."""
        self._flight = None
        return self.outputs.reset(message)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._flight is not None

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs.requests)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess; the outputs of every request that changed."""
        now = self.clock.now()
        self._draft()
        plan = self.scheduler.schedule(now)
        overlaps = self._overlaps(plan)
        if self._flight is None and not overlaps:
            return self._postprocess(plan, self._run(plan), now)
        return self._overlapped(plan, now, overlaps)

    # -- asynchronous scheduling -------------------------------------------------------

    def _overlaps(self, plan: SchedulerOutput) -> bool:
        """Whether ``plan`` may be launched before the step in flight lands and stay
        in flight itself: every sampling chunk plain, of a request that allows it."""
        return (
            self._launcher is not None
            and bool(plan.chunks)
            and all(
                not c.draft and self.outputs.by_seq[c.seq.request_id][0].overlap
                for c in plan.chunks
                if c.samples
            )
            and not self._prompt_logprobs_wanted(plan)
        )

    def _overlapped(self, plan: SchedulerOutput, now: float, overlaps: bool) -> list[RequestOutput]:
        """Launch ``plan`` (reading the tokens of the step in flight on the device),
        then land that step and report it; ``plan`` stays in flight, its sequences
        advanced with ``pending`` tokens. A plan that may not overlap (``overlaps``
        false) runs once the step in flight has landed, as a step without overlap does."""
        flight, self._flight = self._flight, None
        launcher = cast(LaunchingRunner, self._launcher)  # a flight or overlap needs one
        launch = self._launch(launcher, plan, flight) if overlaps else None
        if flight is not None:
            self._land(launcher, flight)
        if launch is None:
            # The flight's stops are known now: its finished sequences run no more.
            plan.chunks[:] = [c for c in plan.chunks if c.seq.status is SequenceStatus.RUNNING]
            return self._postprocess(plan, self._run(plan), now)
        for seq in plan.finished:  # aborted or timed out while planning
            self.outputs.by_seq[seq.request_id][0].touched = True
        outputs = self.outputs.collect()
        # After the report: a sequence this advance ends by its length must not be
        # reported finished before its last token lands.
        self._flight = self._advance(plan, launch, now)
        return outputs

    def _launch(
        self, launcher: LaunchingRunner, plan: SchedulerOutput, flight: _Flight | None
    ) -> Launch | None:
        rows = self._rows(plan)
        try:
            return launcher.launch(plan, rows, None if flight is None else flight.launch)
        except Exception:
            log.exception("launching an engine step failed; running it step by step")
            return None

    def _advance(self, plan: SchedulerOutput, launch: Launch, now: float) -> _Flight:
        """Move ``plan``'s sequences on as if its tokens were known: each sampling one
        takes ``pending(row)`` in its token's place (a length ends it now; a stop
        token or string when the token lands)."""
        at: dict[str, int] = {}
        tokens: dict[str, list[int]] = {}
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.samples and seq.status is SequenceStatus.RUNNING:
                at[seq.request_id] = seq.num_tokens
                tokens[seq.request_id] = [pending(launch.rows[seq.request_id])]
        self.scheduler.update(plan, tokens)
        self.outputs.started(plan, now)
        self._record_step(plan, now, 0)
        with self.stats.update() as s:
            s.launched_steps += 1
        return _Flight(plan, launch, at)

    def _land(self, launcher: LaunchingRunner, flight: _Flight) -> None:
        """Wait for the step in flight; put each token in its ``pending`` place
        (``Scheduler.land``) and emit it (a stop token or string ends its sequence now)."""
        try:
            result = launcher.land(flight.launch)
        except Exception:
            # The step's sequences have moved past it: it cannot be re-run chunk by
            # chunk as a launch that failed is, so every sequence in it fails.
            log.exception("an engine step failed on the device")
            for rid, at in flight.at.items():
                req, i = self.outputs.by_seq[rid]
                del req.seqs[i].token_ids[at:]
                self.outputs.fail(req.seqs[i], "the model failed on this request")
            return
        generated, landed = 0, self.clock.now()
        for chunk in flight.plan.chunks:
            seq, rid = chunk.seq, chunk.seq.request_id
            if rid not in flight.at:
                continue
            token = result.sampled[rid].token_id
            self.scheduler.land(seq, flight.at[rid], token)
            if seq.finish_reason in (FinishReason.ABORT, FinishReason.TIMEOUT):
                continue
            req, i = self.outputs.by_seq[rid]
            req.touched = True
            generated += 1
            try:
                self.outputs.emit(req, i, token, None, landed)
            except Exception:
                log.exception("processing %s's output failed", rid)
                self.outputs.fail(seq, "processing this request's output failed")
        with self.stats.update() as s:
            s.generation_tokens += generated

    def _draft(self) -> None:
        """Give the decoding sequences that may speculate their drafts (or, with
        multi-step decoding, their ``LOOKAHEAD`` placeholders)."""
        if self.lookahead:
            self._lookahead()
        if self.speculator is None:
            return
        running = self.scheduler.running
        for seq in running:
            seq.draft = []  # a draft not scheduled last step is not carried over
        if not self.speculator.drafting(len(running)):
            return
        decoding = {
            s.request_id: s
            for s in running
            if s.num_uncomputed == 1 and self.outputs.by_seq[s.request_id][0].speculate
        }
        limits = [(rid, s.token_ids, self._draft_room(s)) for rid, s in decoding.items()]
        for rid, draft in self.speculator.drafts(limits).items():
            decoding[rid].draft = draft

    def _lookahead(self) -> None:
        for s in self.scheduler.running:
            if s.num_uncomputed != 1 or not self.outputs.by_seq[s.request_id][0].lookahead:
                s.draft = []
                continue
            s.draft = [LOOKAHEAD] * max(0, min(self.lookahead, self._draft_room(s)))

    def _draft_room(self, seq: Sequence) -> int:
        """How many draft tokens (or placeholders) ``seq`` may take: they and the one
        sampled with them must fit its ``max_tokens`` and the model's length."""
        return min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1

    def _forget(self, seq_id: str) -> None:
        """A retired sequence's drafting state goes with it."""
        if self.speculator is not None:
            self.speculator.forget(seq_id)

    def _run(self, plan: SchedulerOutput) -> StepResult:
        if not plan.chunks:
            return StepResult()
        rows = self._rows(plan)
        wanted = self._prompt_logprobs_wanted(plan)
        try:
            return self.runner.execute(plan, rows, wanted)
        except Exception:
            log.exception("engine step failed; retrying its sequences one by one")
        # One chunk at a time: the failing ones fail alone, the others go on.
        result = StepResult()
        for chunk in list(plan.chunks):
            try:
                result.update(self.runner.execute(SchedulerOutput([chunk]), rows, wanted))
            except Exception:
                log.exception("sequence %s failed in the model", chunk.seq.request_id)
                plan.chunks.remove(chunk)
                self.outputs.fail(chunk.seq, "the model failed on this request")
        return result

    def _prompt_logprobs_wanted(self, plan: SchedulerOutput) -> dict[str, int]:
        """The step's sequences whose prompt log-probabilities are wanted (the first
        of a request's sequences speaks for its prompt)."""
        wanted: dict[str, int] = {}
        for chunk in plan.chunks:
            seq = chunk.seq
            if seq.num_computed >= seq.num_prompt_tokens - 1:
                continue  # its prompt is computed (a decoding sequence): nothing is wanted
            req, i = self.outputs.by_seq[seq.request_id]
            k = req.params.prompt_logprobs
            if k is not None and i == 0:
                wanted[seq.request_id] = k
        return wanted

    def _rows(self, plan: SchedulerOutput) -> dict[str, SamplingRow]:
        """The sampling row of each sampling chunk's sequence, by its id."""
        by_seq, rows = self.outputs.by_seq, {}
        for chunk in plan.chunks:
            if chunk.samples:
                req, i = by_seq[chunk.seq.request_id]
                rows[chunk.seq.request_id] = req.rows[i]
        return rows

    def _postprocess(
        self, plan: SchedulerOutput, result: StepResult, now: float
    ) -> list[RequestOutput]:
        sampled = result.sampled
        for seq_id, found in result.prompt_logprobs.items():
            req = self.outputs.by_seq[seq_id][0]
            if req.prompt_logprobs is not None:
                at = found.first + 1
                req.prompt_logprobs[at : at + len(found.entries)] = found.entries
        for seq in plan.finished:  # aborted or timed out while planning
            self.outputs.by_seq[seq.request_id][0].touched = True
        before = {c.seq.request_id: c.seq.num_tokens for c in plan.chunks if c.samples}
        self.scheduler.update(plan, {rid: s.tokens for rid, s in sampled.items()})
        self.outputs.started(plan, now)
        generated, landed = 0, self.clock.now()
        by_seq, emit = self.outputs.by_seq, self.outputs.emit  # per sequence: looked up once
        for chunk in plan.chunks:
            rid = chunk.seq.request_id
            got = sampled.get(rid) if chunk.samples else None
            if got is None:
                continue
            req, i = by_seq[rid]
            new = chunk.seq.token_ids[before[rid] :]
            generated += len(new)
            if chunk.draft:
                self._speculated(chunk.seq, chunk.draft, got)
            try:
                for token in new:
                    emit(req, i, token, got.logprobs, landed)
                    if req.detoks[i].stopped_on is not None:
                        break
            except Exception:
                log.exception("processing %s's output failed", rid)
                self.outputs.fail(chunk.seq, "processing this request's output failed")
        self._record_step(plan, now, generated)
        return self.outputs.collect()

    def _speculated(self, seq: Sequence, draft: tuple[int, ...], sampled: Sampled) -> None:
        if not draft or self.speculator is None:
            return
        self.speculator.accepted(seq.request_id, len(draft), len(sampled.accepted))
        with self.stats.update() as s:
            s.spec_drafts += 1
            s.spec_draft_tokens += len(draft)
            s.spec_accepted_tokens += len(sampled.accepted)

    def _record_step(self, plan: SchedulerOutput, now: float, generated: int) -> None:
        with self.stats.update() as s:
            if plan.chunks:
                s.steps += 1
                s.prompt_steps += plan.has_prompt
                s.tokens_per_step.observe(plan.num_tokens)
            s.generation_tokens += generated
            s.preemptions = self.scheduler.num_preemptions
            s.prefix_queries = self.blocks.stats.queries
            s.prefix_hits = self.blocks.stats.hits
            s.running = len(self.scheduler.running)
            s.waiting = len(self.scheduler.waiting)
            s.kv_usage = self.blocks.usage


def check_request(
    prompt_ids: Seq[int], params: SamplingParams, max_model_len: int, vocab: int
) -> list[int]:
    """Validate a request for a model of ``vocab`` tokens and ``max_model_len`` before
    anything runs (any thread, any process: the engine's own check, and an engine
    process's server's); return its (maybe truncated) prompt. Raises
    ``InvalidRequest`` naming what is wrong."""
    prompt = list(prompt_ids)
    if not prompt:
        raise InvalidRequest("the prompt must not be empty", param="prompt")
    if params.truncate_prompt_tokens is not None:
        prompt = prompt[-params.truncate_prompt_tokens :]
    if len(prompt) >= max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; "
            f"the prompt has {len(prompt)}",
            param="prompt",
        )
    if any(not 0 <= t < vocab for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    if any(not 0 <= t < vocab for t, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
    total = len(prompt) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens; "
            f"the prompt ({len(prompt)}) plus max_tokens ({params.max_tokens}) is {total}",
            param="max_tokens",
        )
    return prompt


def speculable(params: SamplingParams) -> bool:
    """Whether drafts may be verified for ``params``: greedy or plain sampling
    (temperature, top-k, top-p, min-p), with nothing that depends on each token
    emitted before it (penalties, min_tokens, a grammar) and no log-probabilities."""
    return (
        params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
        and not params.min_tokens
        and not params.logit_bias
        and params.grammar is None
        and params.logprobs is None
    )
