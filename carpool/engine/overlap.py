"""Asynchronous scheduling (vLLM's ``async_scheduling``): the engine launches step
N + 1 before step N's tokens are back, so the host's work (scheduling, detokenizing,
stop strings, stream delivery) overlaps the device's.

A step launched is *in flight*: each of its sampling sequences counts one pending
token (``Sequence.num_pending``: planned as if known, absent from ``token_ids``), which
the next launch reads on the device (``LaunchingRunner.launch``'s ``after``). When it
lands, each token takes its place (``Scheduler.land``) and is reported; a stop token
or string found then ends its sequence a step late, and the step launched meanwhile
computes a token nobody reads. A length ends a sequence when its last token is
planned. Only a plan whose sampling sequences all allow it overlaps (no drafts, and
nothing that needs each token on the host before the next: ``drafting.speculable``,
no prompt log-probabilities); any other waits for the flight to land and runs as a
plain step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from carpool.engine.outputs import SchedulerOutput
from carpool.engine.request_output import RequestOutput
from carpool.engine.runner import Launch, LaunchingRunner
from carpool.engine.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from carpool.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """A step launched and not landed: its plan, the runner's launch, and the
    sequences whose token it samples (each holding one pending)."""

    plan: SchedulerOutput
    launch: Launch
    pending: list[Sequence]


class Overlap:
    """The step in flight of ``engine``, whose runner ``launcher`` launches steps.
    The engine's thread only."""

    def __init__(self, engine: Engine, launcher: LaunchingRunner) -> None:
        self.engine = engine
        self.launcher = launcher
        self.flight: Flight | None = None

    def allows(self, plan: SchedulerOutput) -> bool:
        """Whether ``plan`` may be launched before the flight lands and stay in flight
        itself: every sampling chunk plain, of a request that allows it."""
        by_seq = self.engine.outputs.by_seq
        sampling = (c for c in plan.chunks if c.samples)
        return (
            bool(plan.chunks)
            and all(not c.draft and by_seq[c.seq.request_id][0].overlap for c in sampling)
            and not self.engine.prompt_logprobs_wanted(plan)
        )

    def step(self, plan: SchedulerOutput, now: float, overlaps: bool) -> list[RequestOutput]:
        """Launch ``plan`` (``overlaps``: reading the flight's tokens on the device),
        then land the flight and report it; ``plan`` stays in flight. A plan that may
        not overlap runs once the flight has landed, as a plain step does."""
        engine = self.engine
        flight, self.flight = self.flight, None
        launch = self._launch(plan, flight) if overlaps else None
        if flight is not None:
            self._land(flight)
        if launch is None:
            # The flight's stops are known now: its finished sequences run no more.
            plan.chunks[:] = [c for c in plan.chunks if c.seq.status is SequenceStatus.RUNNING]
            return engine.postprocess(plan, engine.run(plan), now)
        for seq in plan.finished:  # aborted or timed out while planning
            engine.outputs.by_seq[seq.request_id][0].touched = True
        outputs = engine.outputs.collect()
        # After the report: a sequence this advance ends by its length must not be
        # reported finished before its last token lands.
        self.flight = self._advance(plan, launch, now)
        return outputs

    def _launch(self, plan: SchedulerOutput, flight: Flight | None) -> Launch | None:
        rows = self.engine.sampling_rows(plan)
        try:
            return self.launcher.launch(plan, rows, None if flight is None else flight.launch)
        except Exception:
            log.exception("launching an engine step failed; running it step by step")
            return None

    def _advance(self, plan: SchedulerOutput, launch: Launch, now: float) -> Flight:
        """Move ``plan``'s sequences on as if its tokens were known: each sampling one
        counts a pending token (a length ends it now; a stop token or string when the
        token lands)."""
        engine = self.engine
        running = SequenceStatus.RUNNING
        pending = [c.seq for c in plan.chunks if c.samples and c.seq.status is running]
        engine.scheduler.update(plan, None)
        engine.outputs.started(plan, now)
        engine.record_step(plan, now, 0)
        with engine.stats.update() as s:
            s.launched_steps += 1
        return Flight(plan, launch, pending)

    def _land(self, flight: Flight) -> None:
        """Wait for ``flight``; put each token in its pending place and report it (a
        stop token or string ends its sequence now)."""
        engine = self.engine
        try:
            result = self.launcher.land(flight.launch)
        except Exception:
            # The step's sequences have moved past it: it cannot be re-run chunk by
            # chunk as a launch that failed is, so every sequence in it fails.
            log.exception("an engine step failed on the device")
            for seq in flight.pending:
                seq.num_pending = 0
                engine.outputs.fail(seq, "the model failed on this request")
            return
        generated, landed = 0, engine.clock.now()
        by_seq = engine.outputs.by_seq
        for seq in flight.pending:
            rid = seq.request_id
            token = result.sampled[rid].token_id
            engine.scheduler.land(seq, token)
            if seq.finish_reason in (FinishReason.ABORT, FinishReason.TIMEOUT):
                continue
            req, i = by_seq[rid]
            req.touched = True
            generated += 1
            try:
                engine.outputs.emit(req, i, token, None, landed)
            except Exception:
                log.exception("processing %s's output failed", rid)
                engine.outputs.fail(seq, "processing this request's output failed")
        with engine.stats.update() as s:
            s.generation_tokens += generated
