"""RadixCache and KVCacheManager: matching, splitting, eviction, sharing, duplicates, stats.

Every test ends with `support.kv_invariants.check_kv_invariants`, the full consistency check of a
manager against the block tables that live sequences hold.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.kv import BlockTable, KVCacheManager
from nanoserve.runtime.stand_in import stand_in_engine, stand_in_generate

from support.kv_invariants import check_kv_invariants, path_tokens

# The stand-in's tensors are tiny: a second intra-op thread only adds barrier waits.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(kv: KVCacheManager, table: BlockTable, tokens: list[int]) -> int:
    """Computes a whole sequence: match, allocate, commit. Returns the matched token count."""
    hit = kv.match(table, tokens)
    assert kv.allocate(table, len(tokens))
    kv.commit(table, tokens, len(tokens))
    return hit


def _drain(kv: KVCacheManager) -> None:
    """With no live sequence, evicting everything must return the whole pool."""
    check_kv_invariants(kv, [])
    if kv.cache is not None:
        assert kv.cache.protected_blocks == 0
        kv.cache.evict(kv.pool.num_blocks)
        assert kv.cache.total_blocks == 0
    assert kv.pool.num_free == kv.pool.num_blocks


def test_full_hit_still_computes_the_last_token():
    kv = KVCacheManager(16, 4)
    tokens = list(range(12))
    a = BlockTable()
    assert _run(kv, a, tokens) == 0
    kv.free(a, tokens, 12)
    assert kv.cache is not None and len(kv.cache.match_prefix(tokens).blocks) == 3  # the tree has it all
    b = BlockTable()
    assert kv.match(b, tokens) == 8  # but a request gets at most len - 1 tokens, block-aligned
    assert b.blocks == kv.cache.match_prefix(tokens).blocks[:2]
    c = BlockTable()
    assert kv.match(c, [*tokens, 99]) == 12
    d = BlockTable()
    assert kv.match(d, tokens[:4]) == 0  # one block: nothing can be reused
    check_kv_invariants(kv, [(b, tokens), (c, [*tokens, 99]), (d, tokens[:4])])
    for t, toks in ((b, tokens), (c, [*tokens, 99]), (d, tokens[:4])):
        kv.free(t, toks, 0)
    _drain(kv)


def test_partial_hit_inside_a_block_reuses_only_whole_blocks():
    kv = KVCacheManager(16, 4)
    tokens = list(range(8))
    a = BlockTable()
    _run(kv, a, tokens)
    query = [0, 1, 2, 3, 4, 5, 77, 78, 79, 80]  # diverges in the middle of the second block
    b = BlockTable()
    assert kv.match(b, query) == 4
    assert b.blocks == a.blocks[:1]
    check_kv_invariants(kv, [(a, tokens), (b, query)])
    kv.free(a, tokens, 8)
    kv.free(b, query, 4)
    _drain(kv)


def test_partial_match_splits_the_node():
    kv = KVCacheManager(16, 2)
    cache = kv.cache
    assert cache is not None
    tokens = [1, 2, 3, 4, 5, 6]
    a = BlockTable()
    _run(kv, a, tokens)
    (node,) = cache.root.children.values()
    assert node.key == tuple(tokens) and node.lock_ref == 1
    result = cache.match_prefix([1, 2, 3, 4, 9, 9])
    upper = result.node
    assert result.blocks == a.blocks[:2]
    assert upper.key == (1, 2, 3, 4) and upper.blocks == a.blocks[:2] and upper.parent is cache.root
    assert node.key == (5, 6) and node.blocks == a.blocks[2:] and node.parent is upper
    assert upper.children == {(5, 6): node} and cache.root.children == {(1, 2): upper}
    assert upper.lock_ref == 1  # the live sequence's lock on the lower part pins the upper part too
    assert (cache.evictable_blocks, cache.protected_blocks) == (0, 3)
    check_kv_invariants(kv, [(a, tokens)])
    kv.free(a, tokens, 6)
    assert (cache.evictable_blocks, cache.protected_blocks) == (3, 0)
    _drain(kv)


def test_eviction_is_lru_and_spares_locked_nodes():
    kv = KVCacheManager(8, 2)
    cache = kv.cache
    assert cache is not None
    seqs = {name: [base, base + 1, base + 2, base + 3] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    for tokens in seqs.values():  # inserted in order a, b, c; all finished
        t = BlockTable()
        _run(kv, t, tokens)
        kv.free(t, tokens, 4)
    assert kv.pool.num_free == 2
    cache.match_prefix(seqs["a"])  # a is now the most recently used
    live = BlockTable()
    live_tokens = [*seqs["b"], 1]
    assert kv.match(live, live_tokens) == 4  # b is pinned by a live sequence
    assert cache.evict(1) == 2  # the oldest unpinned leaf: c
    assert cache.evictions == 2
    probe = BlockTable()
    assert kv.match(probe, [*seqs["c"], 1]) == 0 and kv.match(probe, [*seqs["a"], 1]) == 4
    kv.free(probe, seqs["a"], 0)
    assert cache.evict(100) == 2  # a goes; b is pinned
    assert kv.match(probe, [*seqs["a"], 1]) == 0
    check_kv_invariants(kv, [(live, live_tokens)])
    assert kv.pool.num_free == 6 and cache.total_blocks == 2
    # A pinned node also survives an allocation that wants more than is evictable.
    other = BlockTable()
    assert not kv.allocate(other, 16)
    assert kv.allocate(other, 12) and cache.total_blocks == 2
    kv.free(other, [], 0)
    kv.free(live, live_tokens, 4)
    _drain(kv)


def test_eviction_takes_children_before_their_parent():
    kv = KVCacheManager(16, 2)
    cache = kv.cache
    assert cache is not None
    for tail in ([5, 6], [7, 8]):
        tokens = [1, 2, 3, 4, *tail]
        t = BlockTable()
        _run(kv, t, tokens)
        kv.free(t, tokens, 6)
    assert len(cache.root.children) == 1 and cache.total_blocks == 4
    assert cache.evict(1) == 1 and cache.total_blocks == 3  # one leaf, the shared prefix stays
    assert cache.evict(2) == 3  # the other leaf, then the prefix that became a leaf
    _drain(kv)


def test_concurrent_requests_share_a_prefix():
    kv = KVCacheManager(32, 4)
    prefix = list(range(100, 112))
    a_tokens, b_tokens = [*prefix, 1, 2, 3], [*prefix, 7, 8, 9, 10, 11]
    a, b = BlockTable(), BlockTable()
    _run(kv, a, a_tokens)
    assert kv.match(b, b_tokens) == 12
    assert b.blocks == a.blocks[:3]
    assert kv.allocate(b, len(b_tokens))
    kv.commit(b, b_tokens, len(b_tokens))
    for blk in a.blocks[:3]:
        assert kv.pool.ref_counts[blk] == 3  # a, b and the tree
    check_kv_invariants(kv, [(a, a_tokens), (b, b_tokens)])
    kv.free(a, a_tokens, len(a_tokens))
    assert all(kv.pool.ref_counts[blk] > 0 for blk in b.blocks)
    check_kv_invariants(kv, [(b, b_tokens)])
    kv.free(b, b_tokens, len(b_tokens))
    _drain(kv)


def test_duplicate_insert_never_leaves_a_live_table_on_freed_blocks():
    for first_to_finish in (0, 1):
        kv = KVCacheManager(32, 4)
        cache = kv.cache
        assert cache is not None
        tokens = list(range(50, 66))
        seqs = [BlockTable(), BlockTable()]
        for t in seqs:  # both compute the same prefix before either commits: no match
            assert kv.match(t, tokens) == 0 and kv.allocate(t, 12)
        for t in seqs:
            kv.commit(t, tokens, 12)
        assert set(seqs[0].blocks).isdisjoint(seqs[1].blocks)
        assert cache.total_blocks == 3  # the tree kept one copy, the first committed
        check_kv_invariants(kv, [(t, tokens) for t in seqs])
        done, live = seqs[first_to_finish], seqs[1 - first_to_finish]
        kv.free(done, tokens, 12)
        cache.evict(kv.pool.num_blocks)  # the live sequence's path is pinned: nothing it reads goes
        assert all(kv.pool.ref_counts[b] > 0 and b not in kv.pool.free_block_ids() for b in live.blocks)
        assert cache.total_blocks == 3
        check_kv_invariants(kv, [(live, tokens)])
        # The survivor keeps growing past the shared prefix; its new block joins the tree.
        assert kv.allocate(live, 16)
        kv.commit(live, tokens, 16)
        assert cache.total_blocks == 4
        check_kv_invariants(kv, [(live, tokens)])
        kv.free(live, tokens, 16)
        _drain(kv)


def test_abort_mid_prefill_returns_every_block():
    kv = KVCacheManager(16, 4)
    tokens = list(range(40))
    t = BlockTable()
    assert kv.match(t, tokens) == 0
    for done in (10, 22):  # two chunks computed, then the request is aborted
        assert kv.allocate(t, done)
        kv.commit(t, tokens, done)
    check_kv_invariants(kv, [(t, tokens)])
    kv.free(t, tokens, 22)
    assert kv.cache is not None and kv.cache.total_blocks == 5  # the five whole computed blocks
    assert kv.pool.num_free + kv.cache.total_blocks == 16
    _drain(kv)


def test_abort_mid_prefill_in_the_engine_returns_every_block():
    engine = stand_in_engine(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    engine.add_request("long", list(range(200)), SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    (req,) = engine.scheduler.running
    assert req.num_computed_tokens == 32
    assert engine.abort("long")
    assert not engine.has_unfinished()
    stats = engine.kv_stats()
    assert stats.blocks_used == 0 and stats.blocks_free + stats.blocks_cached == stats.blocks_total
    _drain(engine.kv)


def test_stats_count_evictions_and_admissions():
    kv = KVCacheManager(6, 2)
    tokens = [1, 2, 3, 4, 5, 6]
    a = BlockTable()
    _run(kv, a, tokens)
    kv.free(a, tokens, 6)
    b = BlockTable()
    assert kv.match(b, [*tokens, 7]) == 6
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (0, 0)  # the scheduler records admissions
    kv.free(b, [], 0)
    assert kv.allocate(b, 12)  # the whole pool: all three cached blocks are evicted
    assert kv.cache is not None and kv.cache.evictions == 3
    kv.free(b, [], 0)
    _drain(kv)
    kv.stats.record(10, 4)
    kv.stats.record(6, 0)
    assert (kv.stats.queried_tokens, kv.stats.hit_tokens) == (16, 4) and kv.stats.hit_rate == 0.25


def test_engine_stats_count_each_admission_once():
    engine = stand_in_engine(block_size=4)
    prefix = list(range(100, 112))
    engine.add_request("a", [*prefix, 1], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", [*prefix, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    stats = engine.kv_stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (13 + 14, 12)
    _drain(engine.kv)


def test_a_burst_with_one_prefix_computes_it_once():
    """Four requests with the same 3-block prefix arrive together, with budget for all of them:
    the first computes the prefix and the others are admitted a step later, matching it (without
    the deferral each would compute it alongside). Outputs stay exact."""
    engine = stand_in_engine(block_size=4, max_num_batched_tokens=256)
    prefix = list(range(100, 112))
    prompts = [[*prefix, 1 + i, 2 * i + 3] for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, temperature=0.0))
    first = engine.step().deltas
    assert [d.request_id for d in first] == ["0"]  # the others wait one step for its prefix
    outputs = {d.request_id: list(d.token_ids) for d in first}
    while engine.has_unfinished():
        for d in engine.step().deltas:
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
    assert [outputs[str(i)] for i in range(4)] == [stand_in_generate(p, 5) for p in prompts]
    stats = engine.kv_stats()
    assert stats.prefix_hit_tokens == 3 * 12 and stats.prefix_queried_tokens == 4 * 14
    _drain(engine.kv)


def test_prefix_cache_off_and_contiguous_layouts():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    t = BlockTable()
    assert kv.match(t, list(range(20))) == 0 and kv.allocate(t, 20) and len(t.blocks) == 5
    kv.free(t, list(range(20)), 20)
    _drain(kv)
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, reserve_tokens=16)
    t = BlockTable()
    assert kv.allocate(t, 1) and len(t.blocks) == 4  # reserved up front for the whole max length
    assert kv.allocate(t, 16) and len(t.blocks) == 4
    other = BlockTable()
    assert kv.allocate(other, 1) and not kv.allocate(BlockTable(), 1)
    kv.free(t, [], 0)
    kv.free(other, [], 0)
    _drain(kv)


_ops = st.lists(
    st.tuples(st.sampled_from(["start", "grow", "finish", "evict"]), st.integers(0, 7),
              st.lists(st.integers(0, 2), min_size=1, max_size=24)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(block_size=st.integers(1, 5), num_blocks=st.integers(4, 24), ops=_ops)
def test_random_manager_operations_keep_invariants(block_size, num_blocks, ops):
    """Sequences over a 3-token alphabet (so prefixes collide often) start, grow, finish and get
    evicted in random order; the invariants hold after every operation."""
    kv = KVCacheManager(num_blocks, block_size)
    live: dict[int, tuple[BlockTable, list[int], list[int]]] = {}  # slot -> (table, tokens, [computed])
    for op, slot, tokens in ops:
        if op == "start" and slot not in live:
            table = BlockTable()
            hit = kv.match(table, tokens)
            assert hit < len(tokens) and hit % block_size == 0 and tokens[:hit] == _path_tokens_or_empty(table)
            if kv.allocate(table, len(tokens)):
                kv.commit(table, tokens, len(tokens))
                live[slot] = (table, tokens, [len(tokens)])
            else:
                kv.free(table, tokens, 0)
        elif op == "grow" and slot in live:
            table, seq, computed = live[slot]
            seq.extend(tokens)
            if kv.allocate(table, len(seq)):
                computed[0] = len(seq)
                kv.commit(table, seq, len(seq))
            else:
                del seq[computed[0]:]
        elif op == "finish" and slot in live:
            table, seq, computed = live.pop(slot)
            kv.free(table, seq, computed[0])
        elif op == "evict" and kv.cache is not None:
            kv.cache.evict(slot)
        check_kv_invariants(kv, [(t, s) for t, s, _ in live.values()])
    for table, seq, computed in live.values():
        kv.free(table, seq, computed[0])
    _drain(kv)


def _path_tokens_or_empty(table: BlockTable) -> list[int]:
    return [] if table.node is None else path_tokens(table.node)
