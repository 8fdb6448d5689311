"""Decode attention in chunks (torch reference backend): the split itself, chunked results against
one dense softmax per sequence, and the plan's ordering of decodes by context length."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.attention import AttentionMetadata, TorchAttention
from nanoserve.attention.torch_ref import decode_chunks
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.sequence import Sequence


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 16, 100, 4096])
def test_chunks_cover_every_sequence_within_budget(seed, budget):
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(0, 40))]
    chunks = decode_chunks(lens, 16, budget)
    assert [i for a, b in chunks for i in range(a, b)] == list(range(len(lens)))
    for a, b in chunks:
        padded = max(-(-n // 16) * 16 for n in lens[a:b])
        assert b - a == 1 or padded * (b - a) <= budget


def test_sorted_lengths_need_fewer_chunks():
    rng = random.Random(0)
    lens = [rng.randint(1, 500) for _ in range(64)]
    assert len(decode_chunks(sorted(lens), 16, 4096)) < len(decode_chunks(lens, 16, 4096))


def _decode_batch(seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Decodes only (one query token each), blocks drawn from a shuffled pool."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    width = max(map(len, tables))
    last = [n - 1 for n in seq_lens]  # each sequence's new token, whose K/V the step writes
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, last, strict=True)]
    return AttentionMetadata.build(slots, [t + [0] * (width - len(t)) for t in tables], range(len(seq_lens) + 1),
                                   seq_lens, num_decodes=len(seq_lens), block_size=block_size)


def _dense_decodes(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over all its keys; query head h reads KV head h // group."""
    group = q.shape[1] // cache.shape[3]
    bs = meta.block_size
    out = torch.empty_like(q)
    for s, n in enumerate(meta.seq_lens_cpu):
        slots = [int(meta.block_tables[s, p // bs]) * bs + p % bs for p in range(n)]
        keys = cache[0].flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        values = cache[1].flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,khd->hk", q[s], keys) * scale).softmax(dim=-1)
        out[s] = torch.einsum("hk,khd->hd", probs, values)
    return out


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("budget", [1, 64, 1 << 20])
def test_chunked_decodes_match_dense_attention(sort, budget):
    rng = random.Random(budget)
    seq_lens = [rng.randint(1, 90) for _ in range(23)]
    if sort:
        seq_lens.sort()
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 8, 400
    meta = _decode_batch(seq_lens, block_size, num_blocks, seed=budget)
    g = torch.Generator().manual_seed(budget)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    k, v = (torch.randn(len(seq_lens), kv_heads, head_dim, generator=g) for _ in range(2))
    # A random pool, so that a padding slot leaking into attention would show.
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    out = TorchAttention(decode_chunk_tokens=budget).forward(q, k, v, cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, _dense_decodes(q, cache, meta, head_dim**-0.5), atol=1e-5, rtol=1e-5)


def test_plan_orders_decodes_by_context_length():
    def req(computed: int) -> Sequence:
        r = Sequence(f"r{computed}", list(range(computed + 1)), SamplingParams(), arrival=0)
        r.num_computed_tokens = computed
        return r

    decodes = [(req(n), 1) for n in (50, 7, 300, 7, 20)]
    prefills = [(req(0), 9), (req(3), 4)]
    ordered = StepPlan(prefills[:1] + decodes + prefills[1:]).scheduled
    assert [r.num_computed_tokens for r, _ in ordered[:5]] == [7, 7, 20, 50, 300]
    assert ordered[1][0] is decodes[3][0]  # stable among equal lengths
    assert ordered[5:] == prefills
