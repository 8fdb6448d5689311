"""The full consistency check of a KVCacheManager (pool, block tables, radix tree) against the
(table, tokens) of each live sequence; the prefix cache tests and the engine property tests run it
after every step."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from nanoserve.kv import BlockTable, KVCacheManager
from nanoserve.kv.radix_cache import RadixNode


def path_tokens(node: RadixNode) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def check_kv_invariants(kv: KVCacheManager, live: Sequence[tuple[BlockTable, Sequence[int]]]) -> set[int]:
    """Asserts every bookkeeping invariant of `kv`, given the (table, tokens) of each live sequence.
    Returns the blocks in use (held by a live table or pinned in the tree)."""
    pool, cache, bs = kv.pool, kv.cache, kv.block_size
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free, "duplicate on the free list"
    assert all(pool.ref_counts[b] == 0 for b in free), "a free block is referenced"
    in_tables = Counter(b for table, _ in live for b in table.blocks)
    in_tree: Counter[int] = Counter()
    pinned: set[int] = set()
    expected_locks: Counter[int] = Counter()
    if cache is not None:
        nodes = [node for node, _ in cache.walk()]
        for node in nodes:
            assert node.parent is not None and node.parent.children[node.key[:bs]] is node
            assert len(node.key) == len(node.blocks) * bs > 0
            in_tree.update(node.blocks)
            if node.lock_ref:
                pinned.update(node.blocks)
        assert all(c == 1 for c in in_tree.values()), "a block is stored twice in the tree"
        for table, tokens in live:
            node = table.node
            if node is None:
                assert table.num_cached == 0
                continue
            assert path_tokens(node) == list(tokens[: table.num_cached]), "table path != its tokens"
            while node is not cache.root:
                expected_locks[id(node)] += 1
                node = node.parent
        for node in nodes:
            assert node.lock_ref == expected_locks[id(node)], "lock_ref != live paths through the node"
        assert cache.evictable_blocks == sum(len(n.blocks) for n in nodes if n.lock_ref == 0)
        assert cache.protected_blocks == sum(len(n.blocks) for n in nodes if n.lock_ref > 0)
    for table, tokens in live:
        assert table.num_cached <= len(tokens)
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == in_tables[b] + in_tree[b], f"block {b}: ref count != holders"
    used = set(in_tables) | pinned
    assert not used & set(free), "a block is both free and used"
    assert not (set(in_tree) - pinned) & set(in_tables), "an evictable block is still in a live table"
    evictable = cache.evictable_blocks if cache else 0
    assert len(used) + pool.num_free + evictable == pool.num_blocks
    return used
