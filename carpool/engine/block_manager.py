"""The paged KV cache's bookkeeping: fixed-size blocks, a block table per sequence,
and prefix caching. No torch: the model runner owns the tensors, this owns the ids.

Prefix caching (after vLLM): once a block is full and computed, it is registered
under a hash of its tokens chained with the hash of the block before it, so the
hash names the whole prefix. A later sequence whose prompt starts with the same
full blocks takes references on them instead of recomputing them. A block whose
last reference is dropped goes to the free queue but keeps its content and hash,
so it can still be hit until it is evicted, least recently freed first.

Sliding windows (after vLLM's null block): where every layer attends only its last
``window`` tokens, a block whose tokens no query to come can see is released while
its sequence runs on (``release_behind``). Its table entry then names ``NULL_BLOCK``,
a block reserved for this and never written (the KV cache starts zeroed), so block
tables keep indexing by position and a kernel that reads the entry and masks it
reads finite zeros.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # where a released entry points; reserved only by a windowed manager


class BlockTable:
    """One sequence's blocks, in order, and the prefix hashes of its full blocks;
    the first ``released`` entries are ``NULL_BLOCK`` (behind a sliding window)."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.released = 0

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups in blocks (vLLM counts tokens; blocks times size is that)."""

    queries: int = 0
    hits: int = 0


def slot_of(blocks: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot (block * block_size + offset) of token ``position`` of a
    sequence whose block table is ``blocks``."""
    return blocks[position // block_size] * block_size + position % block_size


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The hash naming a full block of ``tokens`` after the prefix named ``parent``."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


@dataclass
class BlockManager:
    """Allocates KV blocks to sequences; all-or-nothing, never over-committing.

    ``window``: the sliding window every layer of the model attends within (None
    where any layer sees the whole context); set, it reserves ``NULL_BLOCK`` and
    ``release_behind`` frees what falls behind the window."""

    num_blocks: int
    block_size: int
    prefix_caching: bool = True
    window: int | None = None
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if self.window is not None and (self.window < 1 or self.num_blocks < 2):
            raise ValueError("a window must be >= 1 and leave a block beside the null one")
        self._refs = [0] * self.num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}
        # Free blocks, least recently freed first; a cached one may still be hit.
        first = 0 if self.window is None else NULL_BLOCK + 1
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, self.num_blocks))
        self.num_usable = self.num_blocks - first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by some sequence."""
        return 1.0 - self.num_free / self.num_usable

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``token_ids``.

        At least one token is always left to compute, since the model must produce
        logits for the last prompt token. Takes no references and counts nothing:
        pass the result to ``allocate``, and once that succeeds to ``record_prefix``
        (a sequence that waits for blocks looks its prefix up again every step)."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        parent: bytes | None = None
        for i in range(self._full_blocks_before_last(token_ids)):
            parent = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self._cached.get(parent)
            if block is None:
                break
            found.append(block)
        return found

    def record_prefix(self, token_ids: Sequence[int], prefix: Sequence[int]) -> None:
        """Count one admitted sequence's lookup in ``stats``: the full blocks before
        its last token as queries, the ``prefix`` blocks it got as hits."""
        if self.prefix_caching:
            self.stats.queries += self._full_blocks_before_last(token_ids)
            self.stats.hits += len(prefix)

    def _full_blocks_before_last(self, token_ids: Sequence[int]) -> int:
        return (len(token_ids) - 1) // self.block_size

    def allocate(self, table: BlockTable, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Make ``table`` cover ``num_tokens`` tokens, starting from the cached
        ``prefix`` blocks if the table is empty (behind a sliding window, those its
        first query cannot see start the table released). False, with nothing
        changed, if there are not enough free blocks."""
        if prefix and table.blocks:
            raise ValueError("a prefix can only start an empty block table")
        unseen = self._behind(len(prefix) * self.block_size, len(prefix))
        reused_free = sum(1 for b in prefix[unseen:] if self._refs[b] == 0)
        fresh = max(0, self.blocks_needed(num_tokens) - len(table.blocks) - len(prefix))
        if fresh + reused_free > self.num_free:
            return False
        for i, block in enumerate(prefix):
            table.hashes.append(self._hash_of[block])
            if i < unseen:
                table.blocks.append(NULL_BLOCK)
                continue
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table.blocks.append(block)
        table.released = max(table.released, unseen)
        for _ in range(fresh):
            table.blocks.append(self._take_free())
        return True

    def _behind(self, position: int, num_blocks: int) -> int:
        """How many of the first ``num_blocks`` blocks no query at ``position`` or
        later sees (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, min((position - self.window + 1) // self.block_size, num_blocks))

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the blocks that ``num_computed`` computed tokens have filled."""
        if not self.prefix_caching:
            return
        full = min(num_computed // self.block_size, len(table.blocks))
        while len(table.hashes) < full:
            i = len(table.hashes)
            parent = table.hashes[-1] if table.hashes else None
            digest = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            table.hashes.append(digest)
            block = table.blocks[i]
            # An identical block already cached (computed twice concurrently) stays the
            # canonical one; this block is simply not shared. A released entry is no
            # block at all.
            if digest not in self._cached and i >= table.released:
                self._cached[digest] = block
                self._hash_of[block] = digest

    def release_behind(self, table: BlockTable, position: int) -> None:
        """Release the blocks no query at ``position`` or later attends: those whose
        tokens all lie before ``position - window + 1``. Their entries become
        ``NULL_BLOCK``; a block still cached may be hit by a later prefix until it is
        evicted. A step in flight (planned, not yet run) may still read them: a
        block released is written only by a step planned after this call, and steps
        run in the order they are planned."""
        behind = self._behind(position, len(table.blocks))
        for i in range(table.released, behind):
            self._unref(table.blocks[i])
            table.blocks[i] = NULL_BLOCK
        table.released = max(table.released, behind)

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, tail first, so a shared prefix's early
        blocks are the last evicted."""
        for block in reversed(table.blocks[table.released :]):
            self._unref(block)
        table.blocks.clear()
        table.hashes.clear()
        table.released = 0

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        stale = self._hash_of.pop(block, None)
        if stale is not None:
            del self._cached[stale]
        self._refs[block] = 1
        return block

    def check(self, tables: Sequence[BlockTable]) -> None:
        """Assert the invariants: every usable block is free xor referenced,
        references equal the tables' entries, released entries are null and only
        the null block is never handed out, and the cache maps agree."""
        counts = [0] * self.num_blocks
        for table in tables:
            assert all(b == NULL_BLOCK for b in table.blocks[: table.released]), "released"
            for block in table.blocks[table.released :]:
                counts[block] += 1
        assert counts == self._refs, "reference counts match the block tables"
        for block in range(self.num_blocks - self.num_usable, self.num_blocks):
            assert (block in self._free) == (self._refs[block] == 0), f"block {block} free xor used"
        if self.window is not None:
            assert self._refs[NULL_BLOCK] == 0 and NULL_BLOCK not in self._free, "null block"
        assert all(self._hash_of[b] == h for h, b in self._cached.items()), "cache maps agree"
        assert len(self._hash_of) == len(self._cached)
