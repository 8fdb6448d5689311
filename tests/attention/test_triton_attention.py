"""Triton paged-attention kernels against the torch reference, on the CPU under the Triton interpreter.

Shapes are small and everything is fp32: the interpreter's `tl.dot` is wrong for bf16.

Interpreted vs compiled is fixed per process: `@triton.jit` reads TRITON_INTERPRET when it runs,
and triton's own library functions (`tl.cdiv`, `tl.max`, ...) are decorated when triton is
imported. So the kernel cases run only in a process started with TRITON_INTERPRET=1; in any other
session (which may have imported triton, or need compiled kernels on a GPU) the single test
`test_kernels_under_interpreter` re-runs this file in such a subprocess and the cases skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, TorchAttention, TritonAttention, select_backend
from nanoserve.attention.torch_ref import write_kv

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
ATOL = 1e-5


@pytest.mark.skipif(INTERPRETED, reason="already in an interpreted process")
@pytest.mark.slow
def test_kernels_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-o", "addopts=", "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary, summary


def make_batch(specs: list[tuple[int, int]], block_size: int, num_blocks: int, shared_blocks: int = 0,
               seed: int = 0) -> AttentionMetadata:
    """Metadata for sequences given as (seq_len, query_len), decodes (query_len 1) first. Blocks come
    from a shuffled pool; with `shared_blocks`, every sequence's table starts with the same blocks
    (a shared prefix: those blocks hold only cached tokens, never new ones)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_blocks)]
    tables, slots, qsl = [], [], [0]
    for seq_len, q_len in specs:
        assert seq_len - q_len >= shared_blocks * block_size
        table = shared + [free.pop() for _ in range(-(-seq_len // block_size) - shared_blocks)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
        qsl.append(qsl[-1] + q_len)
    block_tables = torch.zeros(len(specs), max(map(len, tables)), dtype=torch.int64)
    for row, table in zip(block_tables, tables, strict=True):
        row[: len(table)] = torch.tensor(table)
    seq_lens = [s for s, _ in specs]
    num_decodes = next((i for i, (_, q) in enumerate(specs) if q > 1), len(specs))
    assert all(q > 1 for _, q in specs[num_decodes:])
    return AttentionMetadata.build(slots, block_tables.numpy(), qsl, seq_lens, num_decodes, block_size)


def compare(backend: AttentionBackend, meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
            head_dim: int = 32, num_blocks: int = 64, dtype: torch.dtype = torch.float32, device: str = "cpu",
            atol: float = ATOL, rtol: float = 0.0) -> None:
    """Runs `backend` in `dtype` on `device` and the torch reference in fp32 on the CPU, on the same
    random inputs and pool (random, so unmasked padding would show; rounded to `dtype` first), and
    asserts equal caches and outputs within atol + rtol * |ref|."""
    g = torch.Generator().manual_seed(1)
    n = meta.query_start_loc_cpu[-1]
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, meta.block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    ref_cache = cache.float()
    scale = head_dim**-0.5
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), ref_cache, meta, scale)
    dev_meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.to(device),
                                   block_tables=meta.block_tables.to(device), seq_lens=meta.seq_lens.to(device),
                                   query_start_loc_device=meta.query_start_loc_device.to(device))
    tri_cache = cache.to(device)
    out = backend.forward(q.to(device), k.to(device), v.to(device), tri_cache, dev_meta, scale)
    assert torch.equal(tri_cache.cpu().float(), ref_cache)
    torch.testing.assert_close(out.cpu().float(), ref, atol=atol, rtol=rtol)


def small_tiles(num_splits: int = 3) -> TritonAttention:
    """The backend with 16-wide tiles, so short contexts span several tiles and decode splits."""
    return TritonAttention(num_splits=num_splits, decode_block_n=16, prefill_block_m=16, prefill_block_n=16)


# Decodes of 1 key (splits 1 and 2 empty), 37 and 70 keys (3 and 5 tiles over 3 splits); a fresh
# prompt (two query tiles), a chunk after a 36-token cached prefix, and one after a 5-token prefix.
MIXED = [(1, 1), (37, 1), (70, 1), (20, 20), (45, 9), (23, 18)]


@interpreted
@pytest.mark.parametrize("block_size", [4, 16, 6])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 1)])
def test_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    meta = make_batch(MIXED, block_size, num_blocks=64, seed=block_size)
    compare(small_tiles(), meta, num_heads, num_kv_heads)


@interpreted
@pytest.mark.parametrize(("block_size", "num_splits"), [(4, 1), (16, 5)])
def test_shared_prefix_blocks(block_size: int, num_splits: int) -> None:
    """Every table starts with the same 32 tokens' blocks; one split, or five (the last two empty)."""
    specs = [(33, 1), (48, 1), (40, 7), (64, 30)]
    meta = make_batch(specs, block_size, num_blocks=80, shared_blocks=32 // block_size, seed=7)
    assert (meta.block_tables[:, 0] == meta.block_tables[0, 0]).all()
    compare(small_tiles(num_splits), meta, num_heads=4, num_kv_heads=2, num_blocks=80)


@interpreted
def test_decode_only_default_tiles_many_splits() -> None:
    """Default 64-wide tiles and the split heuristic: 700 keys -> 3 splits of 256 keys."""
    backend = TritonAttention()
    meta = make_batch([(700, 1), (257, 1), (64, 1)], block_size=16, num_blocks=80, seed=3)
    assert backend.decode_splits(meta) == 3
    compare(backend, meta, num_heads=4, num_kv_heads=1, head_dim=64, num_blocks=80)


@interpreted
def test_prefill_only_default_tiles() -> None:
    """Chunks longer than a 64-row query tile, one after a cached prefix not aligned to a tile."""
    meta = make_batch([(150, 150), (200, 90)], block_size=16, num_blocks=40, seed=5)
    compare(TritonAttention(), meta, num_heads=2, num_kv_heads=1, head_dim=64, num_blocks=40)


@interpreted
def test_decode_padding_row_gets_zeros() -> None:
    """A CUDA-graph batch pads decodes with seq_len 0 (and slot -1): zeros out, other rows intact."""
    from nanoserve.attention.triton_kernels import paged_decode

    meta = make_batch([(37, 1)], block_size=4, num_blocks=16)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 32, generator=g)
    cache = torch.randn(2, 16, 4, 2, 32, generator=g)
    k, v = (c.view(-1, 2, 32)[meta.slot_mapping] for c in cache)  # the cached rows: rewriting them is a no-op
    ref = TorchAttention().forward(q[:1], k, v, cache.clone(), meta, 0.2)
    out = torch.full_like(q, float("nan"))
    tables = torch.cat([meta.block_tables, torch.zeros_like(meta.block_tables)])
    paged_decode(q, cache[0], cache[1], tables, torch.tensor([37, 0]), out, 0.2, num_splits=3, block_n=16)
    torch.testing.assert_close(out[:1], ref, atol=ATOL, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_write_kv_and_skips_padding(dtype: torch.dtype) -> None:
    from nanoserve.attention.triton_kernels import store_kv

    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(6, 3, 16, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([5, 0, 17, 31, 8, -1])  # the last token is padding: the cache keeps its slot
    ref = torch.randn(2, 4, 8, 3, 16, generator=g).to(dtype)
    out = ref.clone()
    write_kv(k[:5], v[:5], ref, slots[:5])
    store_kv(k, v, out[0], out[1], slots)
    assert torch.equal(out, ref)


def test_rejects_head_dim_not_power_of_two() -> None:
    meta = make_batch([(5, 1)], block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        compare(small_tiles(), meta, num_heads=2, num_kv_heads=1, head_dim=48, num_blocks=8)


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_backend("auto", torch.device("cpu")), TorchAttention)
    assert isinstance(select_backend("auto", torch.device("cuda")), TritonAttention)
    assert isinstance(select_backend("torch", torch.device("cuda")), TorchAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        select_backend("triton", torch.device("cpu"))


@pytest.mark.skipif(INTERPRETED, reason="checked once, in the parent process")
def test_backend_without_triton() -> None:
    """The package imports without triton; building the triton backend then says what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, nanoserve.attention as a\n"
        "assert isinstance(a.select_backend('auto', torch.device('cpu')), a.TorchAttention)\n"
        "try:\n    a.TritonAttention()\nexcept ImportError as e:\n    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "needs the `triton` package" in res.stdout


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("num_splits", [None, 8])
def test_gpu_bf16(num_heads: int, num_kv_heads: int, head_dim: int, num_splits: int | None) -> None:
    """Compiled kernels in bf16 against the fp32 reference on the same (bf16-rounded) inputs:
    atol = rtol = 1e-2 (a CPU emulation of the kernels' bf16 numerics stays under 4e-3 here)."""
    specs = [(1, 1), (37, 1), (1000, 1), (4097, 1), (300, 300), (2000, 129), (70, 64)]
    meta = make_batch(specs, block_size=16, num_blocks=600, seed=11)
    compare(TritonAttention(num_splits=num_splits), meta, num_heads, num_kv_heads, head_dim, num_blocks=600,
            dtype=torch.bfloat16, device="cuda", atol=1e-2, rtol=1e-2)
