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

Hybrid models (Gemma 3: sliding layers beside layers that see everything) keep two
pools (``HybridBlockManager``): one for the layers that attend the whole context,
one for the windowed layers, which release what their window has passed. Each
sequence then has a block table in each (``BlockTable.windowed``), and a step's
blocks come from both or neither.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # where a released entry points; reserved only by a windowed manager
UNBOUNDED = 1 << 62  # a sequence length no pool bounds (``max_sequence_tokens``)


class BlockTable:
    """One sequence's blocks, in order, and the prefix hashes of its full blocks;
    the first ``released`` entries are ``NULL_BLOCK`` (behind a sliding window).
    ``windowed``: its table in a hybrid model's windowed pool (``HybridBlockManager``;
    None elsewhere)."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []
        self.released = 0
        self.windowed: BlockTable | None = None

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class Prefix:
    """Cached full blocks a sequence can start from: entry i is the block whose
    prefix hash is ``hashes[i]``, or ``NULL_BLOCK`` where no query of the sequence
    will see it (behind a window: the block need not still be cached).
    ``windowed``: a hybrid model's same prefix in its windowed pool
    (``HybridBlockManager``)."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    windowed: Prefix | None = None

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, part: slice) -> Prefix:
        """The entries ``part`` (of this pool only)."""
        return Prefix(self.blocks[part], self.hashes[part])


NO_PREFIX = Prefix()


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

    def max_sequence_tokens(self, budget: int) -> int:
        """The longest sequence the pool can run alone, with steps of up to ``budget``
        tokens. Behind a window blocks are released as it moves on, so it holds at
        most its window, one step's tokens and a partial block at each end: where
        the pool holds that, any length runs (``UNBOUNDED``: the caller bounds it by
        the model's own limit)."""
        held = self.num_usable * self.block_size
        if self.window is not None and held >= self.window + budget + 2 * self.block_size:
            return UNBOUNDED
        return held

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The prefix hashes of ``token_ids``'s full blocks before its last token
        (the model must compute at least that one, for its logits)."""
        hashes: list[bytes] = []
        parent: bytes | None = None
        for i in range(self._full_blocks_before_last(token_ids)):
            parent = chain_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def match_prefix(self, token_ids: Sequence[int]) -> Prefix:
        """The longest cached full-block prefix of ``token_ids`` (``match_hashes``)."""
        if not self.prefix_caching:
            return NO_PREFIX
        return self.match_hashes(self.prefix_hashes(token_ids))

    def match_hashes(self, hashes: Sequence[bytes]) -> Prefix:
        """The longest prefix of the blocks hashed ``hashes`` whose blocks that its
        first query (at the token after it) sees are cached; the ones behind a
        window are ``NULL_BLOCK`` entries, cached or not.

        Takes no references and counts nothing: pass the result to ``allocate``, and
        once that succeeds to ``record_prefix`` (a sequence that waits for blocks
        looks its prefix up again every step)."""
        if not self.prefix_caching:
            return NO_PREFIX
        found = [self._cached.get(h) for h in hashes]
        if self.window is None:
            length = next((i for i, block in enumerate(found) if block is None), len(found))
        else:
            # Behind the window a block may be gone: try longer prefixes first.
            length = next(
                m
                for m in range(len(found), -1, -1)
                if None not in found[self._behind(m * self.block_size, m) : m]
            )
        unseen = self._behind(length * self.block_size, length)
        blocks = [NULL_BLOCK] * unseen + [b for b in found[unseen:length] if b is not None]
        assert len(blocks) == length
        return Prefix(tuple(blocks), tuple(hashes[:length]))

    def record_prefix(self, token_ids: Sequence[int], prefix: Prefix) -> None:
        """Count one admitted sequence's lookup in ``stats``: the full blocks before
        its last token as queries, the ``prefix`` blocks it got as hits."""
        if self.prefix_caching:
            self.stats.queries += self._full_blocks_before_last(token_ids)
            self.stats.hits += len(prefix)

    def _full_blocks_before_last(self, token_ids: Sequence[int]) -> int:
        return (len(token_ids) - 1) // self.block_size

    def fits(self, table: BlockTable, num_tokens: int, prefix: Prefix = NO_PREFIX) -> bool:
        """Whether ``allocate`` would succeed."""
        if prefix and table.blocks:
            raise ValueError("a prefix can only start an empty block table")
        seen = prefix.blocks[self._unseen(prefix) :]
        reused_free = sum(1 for b in seen if self._refs[b] == 0)
        fresh = max(0, self.blocks_needed(num_tokens) - len(table.blocks) - len(prefix))
        return fresh + reused_free <= self.num_free

    def allocate(self, table: BlockTable, num_tokens: int, prefix: Prefix = NO_PREFIX) -> bool:
        """Make ``table`` cover ``num_tokens`` tokens, starting from the cached
        ``prefix`` (``match_prefix``) if the table is empty; its null entries start
        the table released. False, with nothing changed, if there are not enough
        free blocks."""
        if not prefix and len(table.blocks) * self.block_size >= num_tokens:
            return True  # a decode step within its last block: most calls
        if not self.fits(table, num_tokens, prefix):
            return False
        unseen = self._unseen(prefix)
        table.released = max(table.released, unseen)
        for i, (block, digest) in enumerate(zip(prefix.blocks, prefix.hashes, strict=True)):
            table.hashes.append(digest)
            table.blocks.append(block)
            if i < unseen:
                continue
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        while len(table.blocks) < self.blocks_needed(num_tokens):
            table.blocks.append(self._take_free())
        return True

    def _unseen(self, prefix: Prefix) -> int:
        """How many of ``prefix``'s entries its first query does not see (null)."""
        return self._behind(len(prefix) * self.block_size, len(prefix))

    def _behind(self, position: int, num_blocks: int) -> int:
        """How many of the first ``num_blocks`` blocks no query at ``position`` or
        later sees (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, min((position - self.window + 1) // self.block_size, num_blocks))

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the blocks that ``num_computed`` computed tokens have filled."""
        if not self.prefix_caching or len(table.hashes) >= num_computed // self.block_size:
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
        if self.window is None:
            return
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


@dataclass
class HybridBlockManager:
    """Blocks for a model whose layers attend in two ways (Gemma 3): ``full`` holds
    the KV of the layers that attend the whole context, ``windowed`` (which has a
    window) that of the sliding layers, in a pool of its own, released behind the
    window as a sequence moves on. A sequence's table is its ``full`` one, and its
    ``windowed`` table hangs from it. Every call changes both pools or neither: a
    step gets its blocks in both or waits. Prefix caching asks both: a prefix is
    used as far as both hold it (the windowed pool only what its window sees)."""

    full: BlockManager
    windowed: BlockManager

    def __post_init__(self) -> None:
        if self.full.window is not None or self.windowed.window is None:
            raise ValueError("a hybrid manager pairs a pool without a window and one with")
        if self.full.block_size != self.windowed.block_size:
            raise ValueError("both pools must have the same block size")
        if self.full.prefix_caching != self.windowed.prefix_caching:
            raise ValueError("prefix caching is on for both pools or for neither")

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def num_blocks(self) -> int:
        """The pool of the layers that see everything (``windowed`` has its own)."""
        return self.full.num_blocks

    @property
    def num_free(self) -> int:
        """Free blocks in both pools."""
        return self.full.num_free + self.windowed.num_free

    @property
    def num_usable(self) -> int:
        """Blocks both pools can hand out."""
        return self.full.num_usable + self.windowed.num_usable

    @property
    def stats(self) -> PrefixCacheStats:
        return self.full.stats

    @property
    def usage(self) -> float:
        """The fuller pool's usage: the one that stops admissions first."""
        return max(self.full.usage, self.windowed.usage)

    def max_sequence_tokens(self, budget: int) -> int:
        return min(self.full.max_sequence_tokens(budget), self.windowed.max_sequence_tokens(budget))

    def match_prefix(self, token_ids: Sequence[int]) -> Prefix:
        """The longest prefix both pools hold, as ``full``'s with ``windowed``'s in it."""
        full = self.full.match_prefix(token_ids)
        windowed = self.windowed.match_hashes(full.hashes)
        found = full[: len(windowed)]
        return Prefix(found.blocks, found.hashes, windowed)

    def record_prefix(self, token_ids: Sequence[int], prefix: Prefix) -> None:
        self.full.record_prefix(token_ids, prefix)

    def allocate(self, table: BlockTable, num_tokens: int, prefix: Prefix = NO_PREFIX) -> bool:
        """``BlockManager.allocate`` in both pools, or in neither."""
        windowed, inner = prefix.windowed or NO_PREFIX, self._windowed(table)
        if not self.full.fits(table, num_tokens, prefix):
            return False
        if not self.windowed.fits(inner, num_tokens, windowed):
            return False
        self.full.allocate(table, num_tokens, prefix)
        self.windowed.allocate(inner, num_tokens, windowed)
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        self.full.commit(table, token_ids, num_computed)
        self.windowed.commit(self._windowed(table), token_ids, num_computed)

    def release_behind(self, table: BlockTable, position: int) -> None:
        self.windowed.release_behind(self._windowed(table), position)

    def free(self, table: BlockTable) -> None:
        self.full.free(table)
        self.windowed.free(self._windowed(table))

    def check(self, tables: Sequence[BlockTable]) -> None:
        """Both pools' invariants, and each sequence's two tables the same length."""
        for table in tables:
            assert len(self._windowed(table)) == len(table), "both tables cover the sequence"
        self.full.check(tables)
        self.windowed.check([self._windowed(t) for t in tables])

    @staticmethod
    def _windowed(table: BlockTable) -> BlockTable:
        if table.windowed is None:
            table.windowed = BlockTable()
        return table.windowed


Blocks = BlockManager | HybridBlockManager  # what the scheduler allocates from
