"""The torch reference attention against dense attention computed one sequence at a time: batched
decodes, the batched short-query path (uniform and ragged queries) and long prefill chunks."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.attention import AttentionMetadata, TorchAttention
from nanoserve.attention.torch_ref import SHORT_QUERY_MAX


def _batch(specs: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Metadata for sequences given as (seq_len, query_len), decodes (query_len 1) first, their
    blocks drawn from a shuffled pool."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, qsl = [], [], [0]
    for seq_len, q_len in specs:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    width = max(map(len, tables))
    seq_lens = [s for s, _ in specs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q > 1), len(specs)), block_size=block_size,
    )


def _dense(q, cache, meta, scale, num_heads, num_kv_heads):
    """Each sequence's queries against its keys, by the formula: softmax(q k^T * scale) v with key
    p visible to query i iff p <= seq_len - q_len + i."""
    out = torch.empty_like(q)
    bs = meta.block_size
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[s], meta.query_start_loc_cpu[s + 1]
        slots = [int(meta.block_tables[s, p // bs]) * bs + p % bs for p in range(seq_len)]
        keys = cache[0].flatten(0, 1)[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = cache[1].flatten(0, 1)[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        visible = torch.arange(seq_len)[None, :] <= torch.arange(end - start)[:, None] + seq_len - (end - start)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


@pytest.mark.parametrize(("name", "specs"), [
    ("drafts, uniform", [(9, 1), (30, 5), (17, 5), (40, 5)]),
    ("drafts, ragged", [(12, 1), (3, 1), (30, 5), (17, 2), (21, 3)]),
    ("short prefills and drafts", [(25, 4), (16, 16), (8, 8), (40, 5)]),
    ("with a long chunk between", [(20, 5), (60, SHORT_QUERY_MAX + 9), (33, 5), (18, 17), (7, 3)]),
])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_attention(name, specs, block_size):
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 16, 200
    meta = _batch(specs, block_size, num_blocks, seed=block_size)
    g = torch.Generator().manual_seed(len(name))
    n = meta.query_start_loc_cpu[-1]
    q = torch.randn(n, num_heads, head_dim, generator=g)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g) for _ in range(2))
    # A random pool, so a padding slot or a future token that leaked into attention would show.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    out = TorchAttention().forward(q, k, v, cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, _dense(q, cache, meta, head_dim**-0.5, num_heads, num_kv_heads),
                               atol=1e-5, rtol=1e-5)
