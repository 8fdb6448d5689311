"""The torch reference attention against dense attention computed one sequence at a time: batched
decodes, the batched short-query path (uniform and ragged queries) and long prefill chunks."""

from __future__ import annotations

import pytest
import torch

from nanoserve.attention import TorchAttention
from nanoserve.attention.torch_ref import SHORT_QUERY_MAX

from support.forward import dense_attention, paged_batch


@pytest.mark.parametrize(("name", "specs"), [
    ("drafts, uniform", [(9, 1), (30, 5), (17, 5), (40, 5)]),
    ("drafts, ragged", [(12, 1), (3, 1), (30, 5), (17, 2), (21, 3)]),
    ("short prefills and drafts", [(25, 4), (16, 16), (8, 8), (40, 5)]),
    ("with a long chunk between", [(20, 5), (60, SHORT_QUERY_MAX + 9), (33, 5), (18, 17), (7, 3)]),
])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_attention(name, specs, block_size):
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 16, 200
    meta = paged_batch(specs, block_size, num_blocks, seed=block_size)
    g = torch.Generator().manual_seed(len(name))
    n = meta.query_start_loc_cpu[-1]
    q = torch.randn(n, num_heads, head_dim, generator=g)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g) for _ in range(2))
    # A random pool, so a padding slot or a future token that leaked into attention would show.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    out = TorchAttention().forward(q, k, v, cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, dense_attention(q, cache, meta, head_dim**-0.5, num_heads, num_kv_heads),
                               atol=1e-5, rtol=1e-5)
