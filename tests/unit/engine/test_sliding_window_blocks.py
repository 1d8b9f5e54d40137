"""KV blocks behind a sliding window are released as a sequence moves on: a fake
runner keeps a KV cache of who wrote each slot and checks, for every query of every
step, that each key its window sees is still the one its sequence wrote (a block
released too early and handed to another sequence fails that). Sequences longer
than the whole cache run to the end; steps that wait and steps launched ahead
(asynchronous scheduling) alike, shared prefixes included. Torch-free."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from carpool.config import EngineConfig
from carpool.engine.block_manager import (
    NULL_BLOCK,
    BlockManager,
    BlockTable,
    HybridBlockManager,
    slot_of,
)
from carpool.engine.engine import Engine
from carpool.engine.outputs import SchedulerOutput
from carpool.engine.runner import EngineModelSpec, SamplingRow, StepResult
from carpool.engine.sequence import Sequence
from tests.unit.engine.test_engine_core import (
    ALPHABET,
    EOS,
    CharTokenizer,
    FakeRunner,
    LaunchingFakeRunner,
    greedy,
    ids,
    run,
)

WINDOW = 10
BLOCK = 8
BUDGET = 8
CACHE_BLOCKS = 12  # 11 usable beside the null block: 88 tokens


def content(seq: Sequence, position: int) -> tuple[int, object]:
    """What a slot holding ``position``'s KV must hold: a prompt position's KV is
    its prefix's (shared through the prefix cache), a generated one its sequence's."""
    if position < seq.num_prompt_tokens:
        return position, tuple(seq.token_ids[: position + 1])
    return position, seq.request_id


class WindowChecks:
    """Writes each chunk's KV into a simulated cache, then checks that every key in
    each query's window is where its block table says, unreleased and unclobbered."""

    spec: EngineModelSpec

    def init_cache(self) -> None:
        self.cache: dict[int, tuple[int, object]] = {}
        self.keys_read = 0
        self.most_held = 0

    @staticmethod
    def windowed_table(seq: Sequence) -> BlockTable:
        """The table of the KV the window reads."""
        return seq.block_table

    def check_window(self, step: SchedulerOutput) -> None:
        for chunk in step.chunks:
            seq, table = chunk.seq, self.windowed_table(chunk.seq).blocks
            first = seq.num_computed
            for pos in range(first, first + chunk.num_tokens):
                assert table[pos // BLOCK] != NULL_BLOCK, "a write into a released block"
                self.cache[slot_of(table, pos, BLOCK)] = content(seq, pos)
            for query in range(first, first + chunk.num_tokens):
                for key in range(max(0, query - WINDOW + 1), query + 1):
                    assert table[key // BLOCK] != NULL_BLOCK, f"key {key} released"
                    assert self.cache[slot_of(table, key, BLOCK)] == content(seq, key)
                    self.keys_read += 1
            held = len(table) - self.windowed_table(seq).released
            self.most_held = max(self.most_held, held)


class WindowRunner(WindowChecks, FakeRunner):
    def __init__(self, replies: Mapping[str, str]) -> None:
        super().__init__(replies, num_blocks=CACHE_BLOCKS)
        self.spec = EngineModelSpec(
            "fake", EOS + 1, 10_000, frozenset({EOS}), CharTokenizer(), sliding_window=WINDOW
        )
        self.init_cache()

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        self.check_window(step)
        return super().execute(step, rows, prompt_logprobs)


class LaunchingWindowRunner(WindowRunner, LaunchingFakeRunner):
    """Checked at launch, as a device runs steps in launch order: a step reads its
    keys before any step launched after it writes."""


def long_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.mark.parametrize("launching", [False, True], ids=["waiting", "async"])
def test_sequences_longer_than_the_cache_run_within_their_window(launching: bool) -> None:
    rng = random.Random(7)
    shared = long_text(rng, 30)
    prompts = [shared + long_text(rng, 5) for _ in range(3)] + [long_text(rng, 17)]
    replies = {p: long_text(rng, 150) for p in prompts}
    runner = (LaunchingWindowRunner if launching else WindowRunner)(replies)
    config = EngineConfig(
        block_size=BLOCK, max_num_batched_tokens=BUDGET, async_scheduling=launching
    )
    engine = Engine(runner, config)
    # Every layer windowed, and the cache holds a window and a step: any length.
    assert engine.max_model_len == 10_000
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), ids(prompt), greedy(max_tokens=200))
    finals = run(engine)
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].text == replies[prompt]
    assert len(prompts[0]) + 150 > (CACHE_BLOCKS - 1) * BLOCK, "longer than the cache"
    assert runner.keys_read > 0
    # A sequence never held more than its window, a step and a block at each end.
    assert runner.most_held <= (WINDOW + BUDGET) // BLOCK + 2
    assert engine.blocks.stats.hits > 0, "the shared prompt came from the prefix cache"
    if launching:
        assert runner.launched > 0


def test_without_a_window_the_cache_bounds_the_length() -> None:
    runner = WindowRunner({"a": "b"})
    runner.spec = EngineModelSpec("fake", EOS + 1, 10_000, frozenset({EOS}), CharTokenizer())
    engine = Engine(runner, EngineConfig(block_size=BLOCK, max_num_batched_tokens=BUDGET))
    assert engine.max_model_len == CACHE_BLOCKS * BLOCK


def test_a_cache_too_small_for_a_window_and_two_steps_bounds_the_length() -> None:
    runner = WindowRunner({"a": "b"})
    runner.num_blocks = 4  # 3 usable: 24 tokens, under 10 + 8 + 2 * 8
    engine = Engine(runner, EngineConfig(block_size=BLOCK, max_num_batched_tokens=BUDGET))
    assert engine.max_model_len == 3 * BLOCK


def test_released_blocks_return_to_the_free_queue_and_the_null_block_is_never_given() -> None:
    bm = BlockManager(num_blocks=6, block_size=4, window=5)
    assert bm.num_free == 5 and bm.num_usable == 5
    table = BlockTable()
    assert bm.allocate(table, 17)  # 5 blocks: the whole usable cache
    assert NULL_BLOCK not in table.blocks and bm.num_free == 0
    bm.release_behind(table, 12)  # the query at 12 sees 8..12: blocks 0 and 1 go
    assert table.blocks[:2] == [NULL_BLOCK, NULL_BLOCK] and table.released == 2
    assert bm.num_free == 2
    bm.check([table])
    bm.release_behind(table, 12)  # again: nothing more
    assert bm.num_free == 2
    assert bm.allocate(table, 25) and len(table) == 7 and bm.num_free == 0
    bm.check([table])
    bm.free(table)
    assert bm.num_free == 5 and table.released == 0
    bm.check([table])


def test_a_cached_prefix_starts_released_where_its_first_query_cannot_see() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, window=5)
    prompt = list(range(21))
    first = BlockTable()
    bm.allocate(first, len(prompt))
    bm.commit(first, prompt, len(prompt))
    kept = list(first.blocks)
    bm.free(first)
    hit = bm.match_prefix(prompt)
    assert hit.blocks == (NULL_BLOCK,) * 4 + (kept[4],)
    second = BlockTable()
    assert bm.allocate(second, len(prompt), prefix=hit)
    # The first query is at 20 and sees 16..20: blocks 0..3 are never read.
    assert second.blocks[:4] == [NULL_BLOCK] * 4 and second.released == 4
    assert second.blocks[4] == kept[4] and len(second.hashes) == 5
    bm.check([second])
    bm.free(second)
    bm.check([second])
    assert bm.num_free == 9


FULL_BLOCKS = 64  # the hybrid runner's pool for the layers that see everything


class HybridRunner(WindowRunner):
    """A hybrid model's runner (Gemma 3): its windowed layers' KV in a pool of
    ``CACHE_BLOCKS`` checked as ``WindowRunner`` checks its one pool, and the other
    layers' in a pool of ``FULL_BLOCKS`` whose every key, from the first, must stay
    its sequence's while the sequence runs."""

    def __init__(self, replies: Mapping[str, str]) -> None:
        super().__init__(replies)
        self.num_blocks = FULL_BLOCKS
        self.spec = EngineModelSpec(
            "fake",
            EOS + 1,
            10_000,
            frozenset({EOS}),
            CharTokenizer(),
            hybrid_window=WINDOW,
            window_blocks=CACHE_BLOCKS,
        )
        self.full_cache: dict[int, tuple[int, object]] = {}

    @staticmethod
    def windowed_table(seq: Sequence) -> BlockTable:
        assert seq.block_table.windowed is not None, "a table in the windowed pool"
        return seq.block_table.windowed

    def execute(
        self,
        step: SchedulerOutput,
        rows: Mapping[str, SamplingRow],
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> StepResult:
        for chunk in step.chunks:
            seq, table = chunk.seq, chunk.seq.block_table.blocks
            first = seq.num_computed
            for pos in range(first, first + chunk.num_tokens):
                self.full_cache[slot_of(table, pos, BLOCK)] = content(seq, pos)
            for key in range(first + chunk.num_tokens):
                assert self.full_cache[slot_of(table, key, BLOCK)] == content(seq, key)
        return super().execute(step, rows, prompt_logprobs)


def test_a_hybrid_models_windowed_pool_is_freed_behind_the_window_and_the_other_kept() -> None:
    rng = random.Random(11)
    shared = long_text(rng, 30)
    prompts = [shared + long_text(rng, 5) for _ in range(3)] + [long_text(rng, 17)]
    replies = {p: long_text(rng, 150) for p in prompts}
    runner = HybridRunner(replies)
    engine = Engine(runner, EngineConfig(block_size=BLOCK, max_num_batched_tokens=BUDGET))
    # The layers that see everything bound the length; the windowed pool does not.
    assert engine.max_model_len == FULL_BLOCKS * BLOCK
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), ids(prompt), greedy(max_tokens=200))
    finals = run(engine)
    for i, prompt in enumerate(prompts):
        assert finals[str(i)].outputs[0].text == replies[prompt]
    # Each sequence is longer than the windowed pool, and all four ran through it.
    assert min(len(p) for p in prompts) + 150 > (CACHE_BLOCKS - 1) * BLOCK
    assert runner.most_held <= (WINDOW + BUDGET) // BLOCK + 2
    assert engine.blocks.stats.hits > 0, "the shared prompt came from the prefix cache"


def hybrid(full: int = 16, windowed: int = 16) -> HybridBlockManager:
    return HybridBlockManager(
        BlockManager(full, block_size=4), BlockManager(windowed, block_size=4, window=5)
    )


def test_a_hybrid_allocation_takes_both_pools_or_neither() -> None:
    bm = hybrid(full=16, windowed=4)  # 3 windowed blocks beside the null one
    table = BlockTable()
    assert not bm.allocate(table, 13)  # 4 blocks each: the windowed pool is short
    assert (bm.full.num_free, bm.windowed.num_free) == (16, 3) and not table.blocks
    assert bm.allocate(table, 12)
    assert (bm.full.num_free, bm.windowed.num_free) == (13, 0)
    bm.check([table])
    bm.release_behind(table, 12)  # the query at 12 sees 8..12: two windowed blocks go
    assert (bm.full.num_free, bm.windowed.num_free) == (13, 2)
    assert table.windowed is not None and table.windowed.released == 2 and table.released == 0
    assert bm.allocate(table, 20)
    bm.check([table])
    bm.free(table)
    assert (bm.full.num_free, bm.windowed.num_free) == (16, 3)
    bm.check([table])


def test_a_hybrid_prefix_is_used_as_far_as_both_pools_hold_it() -> None:
    bm = hybrid(full=16, windowed=8)
    prompt = list(range(21))  # five full blocks before the last token
    first = BlockTable()
    assert bm.allocate(first, len(prompt))
    bm.commit(first, prompt, len(prompt))
    bm.release_behind(first, len(prompt))  # the windowed pool keeps blocks 4 and 5
    assert first.windowed is not None
    kept, kept_windowed = list(first.blocks), list(first.windowed.blocks)
    bm.free(first)
    hit = bm.match_prefix(prompt)
    # Its first query (at 20) sees 16..20: the windowed pool needs block 4 only.
    assert len(hit) == 5 and hit.windowed is not None
    assert hit.windowed.blocks[:4] == (NULL_BLOCK,) * 4
    second = BlockTable()
    assert bm.allocate(second, len(prompt), hit)
    assert second.blocks[:5] == kept[:5]
    assert second.windowed is not None and second.windowed.released == 4
    assert second.windowed.blocks[:5] == [NULL_BLOCK] * 4 + [kept_windowed[4]]
    bm.check([second])
    bm.free(second)
    # Evict the windowed pool's cached blocks: the full pool alone cannot serve the
    # prefix, so it is cut to what the windowed pool still holds (nothing).
    filler = BlockTable()
    assert bm.allocate(filler, 7 * 4)
    bm.free(filler)
    assert len(bm.full.match_prefix(prompt)) == 5
    assert len(bm.match_prefix(prompt)) == 0
