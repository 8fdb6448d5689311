"""A local layer's sliding window in every CPU attention path (batched decodes, short queries,
long chunks; the C++ backend hands such steps to the torch one) against dense attention with the
window in its mask: the query at position p sees the keys at p - window < j <= p only."""

from __future__ import annotations

import shutil

import pytest
import torch

from nanoserve.attention import CpuPagedAttention, TorchAttention
from nanoserve.attention.cpu_paged import load_paged_attention
from nanoserve.attention.torch_ref import SHORT_QUERY_MAX

from support.forward import dense_attention, paged_batch

SPECS = [(9, 1), (30, 1), (3, 1), (30, 5), (17, 2), (40, SHORT_QUERY_MAX + 9), (12, 12)]


def _backends() -> list[str]:
    return ["torch"] + (["cpu"] if shutil.which("g++") else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", [1, 4, 7, 64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_window_matches_dense_attention(backend, window, block_size):
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 32, 200
    meta = paged_batch(SPECS, block_size, num_blocks, seed=window + block_size)
    g = torch.Generator().manual_seed(window)
    n = meta.query_start_loc_cpu[-1]
    q = torch.randn(n, num_heads, head_dim, generator=g)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    if backend == "cpu":
        kernel = load_paged_attention()
        assert kernel is not None
        attention: TorchAttention = CpuPagedAttention(kernel)
    else:
        attention = TorchAttention()
    out = attention.forward(q, k, v, cache, meta, head_dim**-0.5, window)
    ref = dense_attention(q, cache, meta, head_dim**-0.5, num_heads, num_kv_heads, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if window < max(meta.seq_lens_cpu):  # the window changed something: without it the result differs
        unwindowed = dense_attention(q, cache, meta, head_dim**-0.5, num_heads, num_kv_heads)
        assert not torch.allclose(out, unwindowed, atol=1e-3)
