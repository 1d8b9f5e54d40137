"""The scheduler: token budget, decode-first, chunked prefill, preemption order,
deadlines, aborts; invariants checked after every step."""

from __future__ import annotations

import random
import zlib

from carpool.engine.block_manager import BlockManager
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.scheduler import Scheduler, SchedulerConfig
from carpool.engine.sequence import FinishReason, Sequence, SequenceStatus


class Harness:
    def __init__(
        self, tokens: int = 16, seqs: int = 8, blocks: int = 64, block_size: int = 4
    ) -> None:
        self.s = Scheduler(SchedulerConfig(tokens, seqs), BlockManager(blocks, block_size))
        self.all: list[Sequence] = []
        self.now = 0.0

    def add(self, rid: str, prompt_len: int, max_tokens: int = 4, **kw: object) -> Sequence:
        seq = Sequence(
            rid,
            [zlib.crc32(rid.encode()) % 50 + i for i in range(prompt_len)],
            max_tokens,
            arrival=self.now,
            **kw,
        )  # type: ignore[arg-type]
        self.now += 1
        self.s.add(seq)
        self.all.append(seq)
        return seq

    def step(self, token: int = 7) -> SchedulerOutput:
        out = self.s.schedule(self.now)
        self.s.check(self.all)
        assert out.num_tokens <= self.s.config.max_num_batched_tokens
        self.s.update(out, {c.seq.request_id: [token] for c in out.chunks if c.samples})
        self.s.check(self.all)
        return out


def step_until_preemption(h: Harness) -> Sequence:
    """Step (at most 20 times) until a sequence is preempted; return it."""
    for _ in range(20):
        out = h.step()
        if out.preempted:
            return out.preempted[0]
    raise AssertionError("no preemption within 20 steps")


def test_decodes_run_before_new_prompts_and_a_long_prompt_is_chunked() -> None:
    h = Harness(tokens=8)
    a = h.add("a", 3, max_tokens=5)
    out = h.step()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 3)]
    long = h.add("long", 20)
    out = h.step()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("long", 7)]
    out = h.step()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("long", 7)]
    assert not out.chunks[1].samples
    out = h.step()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("long", 6)]
    assert out.chunks[1].samples and len(long.output_ids) == 1
    assert len(a.output_ids) == 4


def test_max_num_seqs_caps_the_running_set() -> None:
    h = Harness(tokens=100, seqs=2)
    for i in range(3):
        h.add(f"s{i}", 2)
    out = h.step()
    assert len(out.chunks) == 2 and len(h.s.waiting) == 1


def test_length_and_eos_finish_and_free_blocks() -> None:
    h = Harness()
    by_length = h.add("len", 3, max_tokens=2)
    by_eos = h.add("eos", 3, max_tokens=10, stop_token_ids=frozenset({9}))
    h.step(token=7)
    h.step(token=9)
    assert by_length.finish_reason is FinishReason.LENGTH and by_length.output_ids == [7, 9]
    assert by_eos.finish_reason is FinishReason.STOP
    assert h.s.blocks.num_free == h.s.blocks.num_blocks


def test_out_of_blocks_preempts_the_lowest_priority_most_recent_and_recomputes_it() -> None:
    h = Harness(tokens=64, blocks=4, block_size=4)
    old = h.add("old", 4, max_tokens=8)
    new = h.add("new", 4, max_tokens=8)
    first_preempted = step_until_preemption(h)
    assert first_preempted is new and old.num_preemptions == 0
    while old.status is not SequenceStatus.FINISHED:
        h.step()
    while new.status is not SequenceStatus.FINISHED:
        h.step()
    assert len(new.output_ids) == 8 and new.finish_reason is FinishReason.LENGTH
    assert h.s.blocks.num_free == 4


def test_priority_decides_who_is_preempted() -> None:
    h = Harness(tokens=64, blocks=4, block_size=4)
    urgent_late = h.add("urgent", 4, max_tokens=8, priority=-1)
    relaxed_early = h.add("relaxed", 4, max_tokens=8, priority=5)
    assert step_until_preemption(h) is relaxed_early and urgent_late.num_preemptions == 0


def test_waiting_past_its_deadline_times_out() -> None:
    h = Harness(tokens=4, seqs=1)
    h.add("busy", 2, max_tokens=50)
    late = h.add("late", 2, deadline=5.0)
    h.step()
    h.now = 5.0
    out = h.step()
    assert late in out.finished and late.finish_reason is FinishReason.TIMEOUT


def test_a_deadline_already_past_still_starts_on_an_idle_engine() -> None:
    h = Harness()
    hasty = h.add("hasty", 2, deadline=0.0)
    out = h.step()
    assert [c.seq for c in out.chunks] == [hasty] and not out.finished


def test_a_started_request_preempted_past_its_deadline_resumes() -> None:
    h = Harness(tokens=64, blocks=4, block_size=4)
    h.add("urgent", 4, max_tokens=8, priority=-1)
    relaxed = h.add("relaxed", 4, max_tokens=8, priority=5, deadline=2.0)
    assert step_until_preemption(h) is relaxed
    h.now = 100.0
    while relaxed.status is not SequenceStatus.FINISHED:
        h.step()
    assert relaxed.finish_reason is FinishReason.LENGTH and len(relaxed.output_ids) == 8


def test_abort_frees_everything_at_the_next_step() -> None:
    h = Harness()
    seq = h.add("gone", 9, max_tokens=50)
    h.step()
    assert seq.block_table.blocks
    h.s.abort("gone")
    out = h.step()
    assert seq in out.finished and seq.finish_reason is FinishReason.ABORT
    assert h.s.blocks.num_free == h.s.blocks.num_blocks


def test_shared_prompts_reuse_cached_blocks() -> None:
    h = Harness(tokens=64)
    first = h.add("p", 9)
    h.step()
    twin = Sequence("twin", list(first.prompt_ids), 4, arrival=h.now)
    h.s.add(twin)
    h.all.append(twin)
    out = h.step()
    chunk = next(c for c in out.chunks if c.seq is twin)
    assert chunk.num_tokens == 1 and twin.block_table.blocks[:2] == first.block_table.blocks[:2]


def test_a_prompt_waiting_for_blocks_counts_its_prefix_lookup_once() -> None:
    h = Harness(tokens=64, blocks=6, block_size=4)
    first = h.add("p", 9, max_tokens=3)  # 3 blocks
    h.step()
    stats = h.s.blocks.stats
    assert (stats.queries, stats.hits) == (2, 0)
    # 24 tokens: its first 2 blocks are first's, 4 fresh ones wait for first to end.
    twin = Sequence("twin", [*first.prompt_ids[:8], *range(100, 116)], 4, arrival=h.now)
    h.s.add(twin)
    h.all.append(twin)
    for _ in range(2):
        h.step()
        assert twin.status is SequenceStatus.WAITING
    assert (stats.queries, stats.hits) == (2, 0)
    h.step()
    assert twin.status is SequenceStatus.RUNNING and first.status is SequenceStatus.FINISHED
    assert (stats.queries, stats.hits) == (2 + 5, 2)


def test_random_load_with_aborts_and_scarce_blocks_ends_every_sequence_once() -> None:
    rng = random.Random(11)
    h = Harness(tokens=32, seqs=6, blocks=24, block_size=4)
    ended: dict[str, int] = {}
    for i in range(100):
        h.add(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 12))
    for _ in range(5000):
        if not h.s.has_work:
            break
        if rng.random() < 0.05 and h.s.running:
            h.s.abort(rng.choice(h.s.running).request_id)
        out = h.s.schedule(h.now)
        h.s.check(h.all)
        done = h.s.update(
            out, {c.seq.request_id: [rng.randint(10, 40)] for c in out.chunks if c.samples}
        )
        h.s.check(h.all)
        for seq in [*out.finished, *done]:
            ended[seq.request_id] = ended.get(seq.request_id, 0) + 1
    assert all(s.status is SequenceStatus.FINISHED for s in h.all)
    assert sorted(ended) == sorted(s.request_id for s in h.all) and set(ended.values()) == {1}
    for seq in h.all:
        if seq.finish_reason is FinishReason.LENGTH:
            assert len(seq.output_ids) == seq.max_tokens
    assert h.s.blocks.num_free == h.s.blocks.num_blocks
    assert h.s.num_preemptions > 0, "the pool was small enough to force preemption"


def test_a_draft_runs_with_its_sequence_and_accepted_tokens_count_as_computed() -> None:
    h = Harness(tokens=16, block_size=4)
    a = h.add("a", 3, max_tokens=10)
    h.step()  # prefill: a has 4 tokens, 3 computed
    a.draft = [21, 22, 23]
    out = h.s.schedule(h.now)
    [chunk] = out.chunks
    assert chunk.num_tokens == 4 and chunk.draft == (21, 22, 23) and chunk.samples
    assert chunk.input_ids == [7, 21, 22, 23] and a.draft == []
    h.s.update(out, {"a": [21, 22, 30]})  # two accepted, then the model's own token
    h.s.check(h.all)
    assert a.output_ids == [7, 21, 22, 30] and a.num_computed == a.num_tokens - 1


def test_a_draft_never_preempts_and_shrinks_to_the_budget() -> None:
    h = Harness(tokens=8, blocks=2, block_size=4)  # 8 slots in all
    a = h.add("a", 3, max_tokens=10)
    h.add("b", 3, max_tokens=10)
    h.step()  # both prefilled: 4 tokens each, one block each, none free
    a.draft = [1, 2]  # would need a third block: dropped, b is not preempted for it
    out = h.s.schedule(h.now)
    assert [(c.seq.request_id, c.draft) for c in out.chunks] == [("a", ()), ("b", ())]
    assert not out.preempted
    h = Harness(tokens=3, blocks=8, block_size=4)
    a = h.add("a", 3, max_tokens=10)
    h.step()
    a.draft = [1, 2, 3, 4, 5]
    [chunk] = h.s.schedule(h.now).chunks
    assert chunk.draft == (1, 2) and chunk.num_tokens == 3  # the budget is 3 tokens


def test_lookahead_is_counted_not_written_and_shrinks_to_the_budget() -> None:
    h = Harness(tokens=3, blocks=8, block_size=4)
    a = h.add("a", 3, max_tokens=10)
    h.step()  # prefill: a has 4 tokens, 3 computed
    a.lookahead = 5
    [chunk] = h.s.schedule(h.now).chunks
    # Two passes more fit the budget of 3 tokens; the model runs only a's own token.
    assert (chunk.lookahead, chunk.num_tokens, chunk.num_own) == (2, 3, 1)
    assert chunk.input_ids == [7] and chunk.draft == () and a.lookahead == 0


def test_a_step_in_flight_leaves_its_tokens_pending_until_they_land() -> None:
    h = Harness(tokens=16, block_size=4)
    a = h.add("a", 3, max_tokens=2)
    h.step()  # prefill: a's first token
    out = h.s.schedule(h.now)
    h.s.update(out, None)  # launched, not landed: its token is pending
    assert a.num_pending == 1 and a.num_tokens == 5 and len(a.token_ids) == 4
    # Its length is reached when its last token is planned, not when it lands.
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    h.s.land(a, 2)  # EOS-free token lands
    assert a.output_ids == [7, 2] and a.num_pending == 0
    b = h.add("b", 3, max_tokens=8)
    h.step()
    out = h.s.schedule(h.now)
    h.s.update(out, None)
    [chunk] = h.s.schedule(h.now).chunks  # the next step, planned before b's token lands
    assert chunk.pending and chunk.input_ids == [] and chunk.num_own == 1
    h.s.land(b, 9)
    assert chunk.input_ids == [9] and not chunk.pending
    h.s.check(h.all)
