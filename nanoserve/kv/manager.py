"""KV cache manager: block tables of live sequences over the block pool and the prefix cache.

Pure Python policy (no torch), shared by the scheduler. Two layouts over the same pool:
- 'paged': a sequence's table grows one block at a time as its tokens arrive (O(1) append);
- 'contiguous': a sequence reserves blocks for `reserve_tokens` (max_model_len) at admission,
  the classic per-request reservation, kept for comparison.

Invariants: a live sequence holds one pool reference per entry of its table and locks the
deepest radix node whose blocks it matched or inserted; `free` returns both.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from nanoserve.kv.block_pool import BlockPool
from nanoserve.kv.radix_cache import RadixCache, RadixNode


def blocks_needed(num_tokens: int, block_size: int, reserve_blocks: int = 0) -> int:
    """Blocks a sequence of `num_tokens` tokens holds: `reserve_blocks` when the layout reserves a
    fixed number per sequence (contiguous), else ceil(num_tokens / block_size). The one formula of
    both the KV manager and request validation, so a request that validates can be allocated."""
    return reserve_blocks or -(-num_tokens // block_size)


class KVStats(NamedTuple):
    """Pool occupancy. used: referenced by live sequences; cached: held by the prefix tree (some of
    them may also be used); free: on the free list. used + free + unpinned cached == total."""

    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_evicted_blocks: int


class BlockState(enum.IntEnum):
    """What holds a block (`KVCacheManager.block_states`). FREE: on the free list; USED: held by
    live sequences only; CACHED: in the prefix tree on no live sequence's path (evictable);
    PINNED: in the prefix tree on a path a live sequence locks (not evictable)."""

    FREE = 0
    USED = 1
    CACHED = 2
    PINNED = 3


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks. Tokens [0, num_cached) sit in the radix tree along the path that ends
    at `node` (block-aligned); the table may still hold the caller's own duplicates of them."""

    blocks: list[int] = field(default_factory=list)
    node: RadixNode | None = None
    num_cached: int = 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups of admitted sequences (recorded once per admission, not per attempt)."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    def record(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 reserve_tokens: int | None = None) -> None:
        if reserve_tokens is not None and enable_prefix_caching:
            raise ValueError("the prefix cache needs the paged layout; disable one of them")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        self.reserve_blocks = 0 if reserve_tokens is None else blocks_needed(reserve_tokens, block_size)
        self.stats = PrefixCacheStats()

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.total_blocks if self.cache else 0

    def snapshot(self) -> KVStats:
        """The pool's occupancy and the prefix cache's counters now."""
        pool, cache = self.pool, self.cache
        evictable = cache.evictable_blocks if cache else 0
        return KVStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_blocks - pool.num_free - evictable,
            blocks_free=pool.num_free, blocks_cached=self.num_cached_blocks,
            prefix_queried_tokens=self.stats.queried_tokens, prefix_hit_tokens=self.stats.hit_tokens,
            prefix_evicted_blocks=cache.evictions if cache else 0,
        )

    def block_states(self, tables: Iterable[BlockTable]) -> npt.NDArray[np.uint8]:
        """One `BlockState` per block id, given the block tables of every live sequence. Counts
        agree with the pool and the tree: FREE == pool.num_free, CACHED == cache.evictable_blocks,
        PINNED == cache.protected_blocks. A referenced block is held by a live table or by the tree,
        and the locked nodes are the paths from the live tables' nodes to the root, so this reads
        the reference counts (vectorised), the live tables and the locked paths, never the whole
        tree."""
        refs = np.fromiter(self.pool.ref_counts, dtype=np.int32, count=self.pool.num_blocks)
        if self.cache is None:
            return (refs > 0).astype(np.uint8)  # FREE or USED
        states = np.where(refs > 0, BlockState.CACHED, BlockState.FREE).astype(np.uint8)
        live: list[int] = []
        pinned: list[int] = []
        locked: set[int] = set()
        for table in tables:
            live.extend(table.blocks)
            node = table.node
            while node is not None and node is not self.cache.root and id(node) not in locked:
                locked.add(id(node))
                pinned.extend(node.blocks)
                node = node.parent
        states[live] = BlockState.USED
        states[pinned] = BlockState.PINNED
        return states

    def match(self, table: BlockTable, tokens: list[int]) -> int:
        """Points an empty table at the longest cached prefix of `tokens` and returns how many
        tokens it covers. At most len(tokens) - 1 tokens are matched: the last one is always
        computed, so a fully cached prompt still yields logits. Records no stats: the caller does,
        once the sequence is admitted (a failed admission is retried, and matched again)."""
        assert not table.blocks
        if self.cache is None or len(tokens) <= self.block_size:
            return 0
        usable = (len(tokens) - 1) // self.block_size * self.block_size
        result = self.cache.match_prefix(tokens[:usable])
        if not result.blocks:
            return 0
        self.pool.incref(result.blocks)
        self.cache.lock(result.node)
        table.blocks, table.node = list(result.blocks), result.node
        table.num_cached = len(result.blocks) * self.block_size
        return table.num_cached

    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Grows the table to hold `num_tokens` tokens, evicting cached blocks if needed. Returns
        False, changing nothing, if the pool cannot supply them."""
        need = blocks_needed(num_tokens, self.block_size, self.reserve_blocks) - len(table.blocks)
        if need <= 0:
            return True
        short = need - self.pool.num_free
        if short > 0:
            if self.cache is None or self.cache.evictable_blocks < short:
                return False
            self.cache.evict(short)
        table.blocks.extend(self.pool.allocate(need))
        return True

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Releases the table's blocks past those `num_tokens` tokens need (lookahead blocks of
        rejected drafts). Never touches cached blocks: they hold computed tokens only."""
        keep = blocks_needed(num_tokens, self.block_size, self.reserve_blocks)
        if len(table.blocks) > keep:
            self.pool.decref(table.blocks[keep:])
            del table.blocks[keep:]

    def commit(self, table: BlockTable, tokens: list[int], num_computed: int) -> None:
        """Publishes the sequence's newly completed blocks (whole blocks of computed tokens) to the
        prefix cache, so that requests arriving later can share them."""
        if self.cache is None:
            return
        full = num_computed // self.block_size * self.block_size
        if full <= table.num_cached:
            return
        first, end = table.num_cached // self.block_size, full // self.block_size
        node = self.cache.insert(tokens[table.num_cached : full], table.blocks[first:end], start=table.node)
        self.cache.lock(node)
        if table.node is not None:
            self.cache.unlock(table.node)
        table.node, table.num_cached = node, full

    def free(self, table: BlockTable, tokens: list[int], num_computed: int) -> None:
        """Caches what the sequence computed, then releases its references. The table is empty after."""
        self.commit(table, tokens, num_computed)
        if table.node is not None and self.cache is not None:
            self.cache.unlock(table.node)
        self.pool.decref(table.blocks)
        table.blocks, table.node, table.num_cached = [], None, 0
