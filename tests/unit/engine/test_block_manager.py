"""The block manager: allocation, prefix sharing, LRU eviction, no leaked block."""

from __future__ import annotations

import random

from carpool.engine.block_manager import BlockManager, BlockTable


def test_allocation_covers_the_tokens_and_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = BlockTable()
    assert bm.allocate(a, 10)
    assert len(a) == 3 and bm.num_free == 1
    b = BlockTable()
    assert not bm.allocate(b, 8)
    assert len(b) == 0 and bm.num_free == 1, "a refused allocation changes nothing"
    assert bm.allocate(a, 12) and len(a) == 3, "growing within the last block needs no block"
    assert bm.allocate(a, 13) and len(a) == 4
    bm.check([a, b])
    bm.free(a)
    assert bm.num_free == 4 and bm.usage == 0.0
    bm.check([a, b])


def test_full_blocks_of_a_shared_prefix_are_reused() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    first = BlockTable()
    assert not bm.match_prefix(prompt)
    bm.allocate(first, len(prompt))
    bm.commit(first, prompt, num_computed=len(prompt))
    second = BlockTable()
    other = [*prompt[:8], 99, 98, 97]
    hit = bm.match_prefix(other)
    assert list(hit.blocks) == first.blocks[:2]
    assert bm.allocate(second, len(other), prefix=hit)
    assert second.blocks[:2] == first.blocks[:2] and second.blocks[2] != first.blocks[2]
    assert bm.num_free == 8 - 3 - 1
    bm.check([first, second])
    assert bm.stats.hits == 0  # lookups count when recorded, not when made
    bm.record_prefix(other, hit)
    assert (bm.stats.queries, bm.stats.hits) == (2, 2)


def test_a_prompt_of_whole_blocks_still_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    table = BlockTable()
    bm.allocate(table, 8)
    bm.commit(table, prompt, 8)
    assert len(bm.match_prefix(prompt)) == 1


def test_freed_blocks_stay_hittable_until_evicted_least_recent_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    table = BlockTable()
    bm.allocate(table, 5)
    bm.commit(table, prompt, 5)
    bm.free(table)
    assert bm.num_free == 4
    assert len(bm.match_prefix(prompt)) == 2, "freed but not evicted: still cached"
    # Freed tail first: the third block, then the second, then the first go first.
    filler = BlockTable()
    bm.allocate(filler, 2)  # takes the never-used block 3
    bm.allocate(filler, 4)  # evicts the freed third block (uncached, partial)
    bm.allocate(filler, 6)  # evicts the second block of the prompt
    assert len(bm.match_prefix(prompt)) == 1
    bm.check([filler])


def test_reusing_a_free_cached_block_takes_it_off_the_free_queue() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    prompt = [7, 7, 8, 8, 9]
    t1 = BlockTable()
    bm.allocate(t1, 5)
    bm.commit(t1, prompt, 5)
    bm.free(t1)
    t2 = BlockTable()
    hit = bm.match_prefix(prompt)
    assert bm.allocate(t2, 5, prefix=hit)
    assert bm.num_free == 0
    bm.check([t2])


def test_without_prefix_caching_nothing_is_shared() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=False)
    t = BlockTable()
    bm.allocate(t, 4)
    bm.commit(t, [1, 2, 3, 4], 4)
    assert not bm.match_prefix([1, 2, 3, 4, 5])


def test_random_allocate_grow_commit_free_never_leaks() -> None:
    rng = random.Random(3)
    bm = BlockManager(num_blocks=32, block_size=4)
    vocab = [1, 2, 3]
    live: list[tuple[BlockTable, list[int]]] = []
    for _ in range(2000):
        action = rng.random()
        if action < 0.35:
            tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 20))]
            table = BlockTable()
            if bm.allocate(table, len(tokens), prefix=bm.match_prefix(tokens)):
                bm.commit(table, tokens, len(tokens))
                live.append((table, tokens))
        elif action < 0.7 and live:
            table, tokens = rng.choice(live)
            tokens.append(rng.choice(vocab))
            if bm.allocate(table, len(tokens)):
                bm.commit(table, tokens, len(tokens))
            else:
                tokens.pop()
        elif live:
            table, _ = live.pop(rng.randrange(len(live)))
            bm.free(table)
        bm.check([t for t, _ in live])
    for table, _ in live:
        bm.free(table)
    bm.check([])
    assert bm.num_free == bm.num_blocks
