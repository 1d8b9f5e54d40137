"""The generation engine: requests in, one step at a time, outputs out.

``step`` reads as three verbs over plain data: the scheduler plans the step, the
model runner runs it and samples, and ``postprocess`` feeds the tokens back to the
scheduler and hands each to the output processor (``output_processor``: requests'
state, detokenizing, stop strings, grammars, reports). Before planning, the engine's
drafter (``drafting``, one chosen at construction: none, lookahead or speculation)
gives decoding sequences their extra tokens. With asynchronous scheduling the middle
verb splits in two: step N + 1 is launched, then step N lands and is reported while
the device runs N + 1 (``overlap``). Single-threaded: the device runtime's thread
calls ``add_request``, ``abort`` and ``step`` (``AsyncEngine`` posts them there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from carpool.clock import Clock, MonotonicClock
from carpool.config import EngineConfig
from carpool.engine.block_manager import BlockManager, Blocks, HybridBlockManager
from carpool.engine.detokenizer import IncrementalDetokenizer
from carpool.engine.drafting import drafter_for, speculable
from carpool.engine.output_processor import EngineRequest, OutputProcessor
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.overlap import Overlap
from carpool.engine.request_output import CompletionOutput, RequestOutput
from carpool.engine.runner import LaunchingRunner, Runner, Sampled, SamplingRow, StepResult
from carpool.engine.sampling_params import SamplingParams
from carpool.engine.scheduler import Scheduler, SchedulerConfig
from carpool.engine.sequence import Sequence
from carpool.engine.speculative import Proposer
from carpool.errors import InvalidRequest
from carpool.stats import EngineStats

if TYPE_CHECKING:
    from carpool.paths import PathTaken

log = logging.getLogger(__name__)


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
        self.drafter = drafter_for(self.config, runner, proposer)
        # Asynchronous scheduling, where the runner launches steps; the config refuses
        # it beside speculation and multi-step decoding.
        self.overlap: Overlap | None = None
        if self.config.async_scheduling and isinstance(runner, LaunchingRunner):
            self.overlap = Overlap(self, runner)
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
        req.drafts = self.drafter.allows(params)
        req.overlap = self.overlap is not None and speculable(params)
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
        if self.overlap is not None:
            self.overlap.flight = None
        return self.outputs.reset(message)

    @property
    def in_flight(self) -> bool:
        """Whether a step is launched and not landed (asynchronous scheduling)."""
        return self.overlap is not None and self.overlap.flight is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs.requests)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess; the outputs of every request that changed."""
        now = self.clock.now()
        self.drafter.draft(self.scheduler.running, self._drafts_wanted, self._draft_room)
        plan = self.scheduler.schedule(now)
        overlap = self.overlap
        overlaps = overlap is not None and overlap.allows(plan)
        if overlap is None or (overlap.flight is None and not overlaps):
            return self.postprocess(plan, self.run(plan), now)
        return overlap.step(plan, now, overlaps)

    def _drafts_wanted(self, seq: Sequence) -> bool:
        return self.outputs.by_seq[seq.request_id][0].drafts

    def _draft_room(self, seq: Sequence) -> int:
        """How many draft tokens (or lookahead passes) ``seq`` may take: they and the
        one sampled with them must fit its ``max_tokens`` and the model's length."""
        return min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1

    def _forget(self, seq_id: str) -> None:
        """A retired sequence's drafting state goes with it."""
        self.drafter.forget(seq_id)

    def run(self, plan: SchedulerOutput) -> StepResult:
        """Run ``plan`` on the runner; a step that raises is run again chunk by chunk,
        so the chunks that fail fail alone."""
        if not plan.chunks:
            return StepResult()
        rows = self.sampling_rows(plan)
        wanted = self.prompt_logprobs_wanted(plan)
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

    def prompt_logprobs_wanted(self, plan: SchedulerOutput) -> dict[str, int]:
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

    def sampling_rows(self, plan: SchedulerOutput) -> dict[str, SamplingRow]:
        """The sampling row of each sampling chunk's sequence, by its id."""
        by_seq, rows = self.outputs.by_seq, {}
        for chunk in plan.chunks:
            if chunk.samples:
                req, i = by_seq[chunk.seq.request_id]
                rows[chunk.seq.request_id] = req.rows[i]
        return rows

    def postprocess(
        self, plan: SchedulerOutput, result: StepResult, now: float
    ) -> list[RequestOutput]:
        """Feed ``result``'s tokens to the scheduler and each to its request's output
        processing; the outputs of every request that changed."""
        sampled = result.sampled
        for seq_id, found in result.prompt_logprobs.items():
            req = self.outputs.by_seq[seq_id][0]
            if req.prompt_logprobs is not None:
                at = found.first + 1
                req.prompt_logprobs[at : at + len(found.entries)] = found.entries
        for seq in plan.finished:  # aborted or timed out while planning
            self.outputs.by_seq[seq.request_id][0].touched = True
        before = {c.seq.request_id: len(c.seq.token_ids) for c in plan.chunks if c.samples}
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
        self.record_step(plan, now, generated)
        return self.outputs.collect()

    def _speculated(self, seq: Sequence, draft: tuple[int, ...], sampled: Sampled) -> None:
        self.drafter.accepted(seq.request_id, len(draft), len(sampled.accepted))
        with self.stats.update() as s:
            s.spec_drafts += 1
            s.spec_draft_tokens += len(draft)
            s.spec_accepted_tokens += len(sampled.accepted)

    def record_step(self, plan: SchedulerOutput, now: float, generated: int) -> None:
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
