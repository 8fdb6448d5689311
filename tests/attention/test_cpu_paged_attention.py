"""The CPU attention backend: the C++ paged-attention kernel against dense attention computed one
sequence at a time (decodes, drafts, and prefill chunks longer than a tile of 16 tokens, mixed in
one batch), its tiling, its fallbacks, and how 'auto' selects it (the build cache: test_layer_ops.py).

The kernel is built with the machine's g++ (CI machines have one); on a machine without a compiler
these tests skip, and only then, since `select_backend('auto')` falls back to torch there."""

from __future__ import annotations

import shutil

import pytest
import torch

from nanoserve import kernel_build
from nanoserve.attention import CpuPagedAttention, TorchAttention, select_backend
from nanoserve.attention.cpu_paged import HEAD_DIMS, load_paged_attention

from support.forward import dense_attention, paged_batch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def backend() -> CpuPagedAttention:
    kernel = load_paged_attention()
    assert kernel is not None, "g++ is installed, so the kernel must build"
    return CpuPagedAttention(kernel)


def _inputs(specs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    num_blocks = sum(-(-s // block_size) for s, _ in specs) + 8
    meta = paged_batch(specs, block_size, num_blocks, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = meta.query_start_loc_cpu[-1]
    q = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    # A random pool, so a padding slot or a future token that leaked into attention would show.
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, cache, meta


def _expected(q, k, v, cache, meta, scale):
    """Dense attention in float64 over the pool after the step's K/V are written."""
    full = cache.double().clone()
    *_, kvh, d = full.shape
    full[0].view(-1, kvh, d)[meta.slot_mapping] = k.double()
    full[1].view(-1, kvh, d)[meta.slot_mapping] = v.double()
    return dense_attention(q.double(), full, meta, scale, q.shape[1], kvh)


SPECS = {
    "decodes": [(1, 1), (17, 1), (300, 1), (64, 1), (33, 1)],
    "decodes and drafts": [(9, 1), (30, 5), (17, 5), (40, 5), (3, 2)],
    "short prefills": [(25, 4), (16, 16), (8, 8), (1, 1)],
    "with long chunks": [(20, 1), (60, 25), (33, 5), (40, 40), (7, 3)],
    # Longer than one tile (16 new tokens): 17 is a tile and a token, 40 two tiles and a half, 130
    # eight tiles and two tokens. After earlier context a chunk starts inside a block ((48, 32): on
    # a block boundary at block size 16).
    "long prefills": [(17, 17), (40, 40), (130, 130)],
    "long chunks after context": [(50, 17), (100, 40), (300, 130), (48, 32)],
    "long chunks among decodes": [(20, 1), (9, 1), (300, 1), (64, 17), (40, 40), (33, 5), (200, 130), (7, 3)],
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (2, 2, 32), (8, 2, 128), (4, 1, 256)])
def test_fp32_matches_dense_attention(backend, name, block_size, num_heads, num_kv_heads, head_dim):
    q, k, v, cache, meta = _inputs(SPECS[name], block_size, num_heads, num_kv_heads, head_dim, torch.float32,
                                   seed=block_size + head_dim)
    scale = head_dim**-0.5
    expected = _expected(q, k, v, cache, meta, scale)
    out = backend.forward(q, k, v, cache, meta, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    # The step's K/V went into the pool at their slots.
    torch.testing.assert_close(cache[0].view(-1, num_kv_heads, head_dim)[meta.slot_mapping], k)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_k_v_as_columns_of_a_fused_qkv(backend, name, dtype):
    """As the decoder passes them with fused layer ops: q, k and v are column slices of one [tokens,
    (heads + 2 * kv_heads) * head_dim] tensor (tokens that far apart). Same result and same pool
    as with contiguous copies."""
    q, k, v, cache, meta = _inputs(SPECS[name], 16, 4, 2, 64, dtype, seed=9)
    n = q.shape[0]
    qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    qs, ks, vs = (t.view(n, -1, 64) for t in qkv.split([4 * 64, 2 * 64, 2 * 64], dim=1))
    assert not qs.is_contiguous() and not ks.is_contiguous()
    pool = cache.clone()
    expected = backend.forward(q, k, v, cache, meta, 0.125)
    assert torch.equal(backend.forward(qs, ks, vs, pool, meta, 0.125), expected)
    assert torch.equal(pool, cache)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (2, 2, 32), (8, 2, 128)])
def test_bf16_matches_dense_attention(backend, name, num_heads, num_kv_heads, head_dim):
    q, k, v, cache, meta = _inputs(SPECS[name], 16, num_heads, num_kv_heads, head_dim, torch.bfloat16, seed=7)
    scale = head_dim**-0.5
    expected = _expected(q, k, v, cache, meta, scale)
    out = backend.forward(q, k, v, cache, meta, scale)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of the result (relative 2^-8) on values of order 1.
    torch.testing.assert_close(out.double(), expected, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (2, 2, 32), (8, 2, 128)])
def test_long_queries_match_the_torch_backend(backend, dtype, num_heads, num_kv_heads, head_dim):
    """What the kernel now attends in place of `TorchAttention`'s per-sequence SDPA (chunks of more
    than 16 new tokens) agrees with it, in both dtypes, and writes the same pool."""
    q, k, v, cache, meta = _inputs(SPECS["long chunks among decodes"], 16, num_heads, num_kv_heads, head_dim, dtype,
                                   seed=head_dim)
    scale = head_dim**-0.5
    pool = cache.clone()
    out = backend.forward(q, k, v, cache, meta, scale)
    reference = TorchAttention().forward(q, k, v, pool, meta, scale)
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2  # bf16: each side rounds its result once
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)
    assert torch.equal(pool, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_a_row_does_not_depend_on_the_tiling(backend, dtype, block_size):
    """Token i of a long chunk (tiles of 16 tokens) gets, bit for bit, what a query of that token
    alone gets over the same prefix: the arithmetic of a row is the same whichever tile holds it."""
    q, k, v, cache, meta = _inputs([(5, 1), (300, 130)], block_size, 4, 2, 64, dtype, seed=block_size)
    out = backend.forward(q, k, v, cache, meta, 0.125)  # writes the step's K/V into the pool
    start, seq_len, q_len = meta.query_start_loc_cpu[1], 300, 130
    for i in (0, 15, 16, 17, 31, 100, 129):
        alone = torch.empty_like(q[:1])
        backend.kernel(q[start + i : start + i + 1], cache, alone, meta.block_tables[1:],
                       torch.tensor([seq_len - q_len + i + 1]), torch.tensor([0, 1]), 0.125, 1)
        assert torch.equal(alone[0], out[start + i]), i


def test_extreme_scores_stay_finite(backend):
    """Scores in the hundreds: the online softmax's rescaling must neither overflow nor lose the
    one dominant key."""
    q, k, v, cache, meta = _inputs([(50, 1), (70, 3)], 16, 4, 2, 64, torch.float32, seed=3)
    q = q * 40
    out = backend.forward(q, k, v, cache, meta, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _expected(q, k, v, cache, meta, 0.125), atol=1e-4, rtol=1e-4)


def test_head_size_without_a_build_falls_back_to_torch(backend):
    assert 48 not in HEAD_DIMS
    q, k, v, cache, meta = _inputs(SPECS["decodes and drafts"], 4, 4, 2, 48, torch.float32, seed=5)
    out = backend.forward(q, k, v, cache, meta, 48**-0.5)
    torch.testing.assert_close(out.double(), _expected(q, k, v, cache, meta, 48**-0.5), atol=2e-5, rtol=2e-5)


def test_kv_write_refuses_a_slot_outside_the_pool(backend):
    _, k, v, cache, meta = _inputs([(20, 1), (9, 2)], 16, 4, 2, 64, torch.float32, seed=4)
    pool = cache.clone()
    bad = meta.slot_mapping.clone()
    bad[-1] = cache.shape[1] * cache.shape[2]
    with pytest.raises(IndexError, match="outside the pool"):
        backend.kernel.write_kv(k, v, pool, bad)
    assert torch.equal(pool, cache)  # nothing written


def test_kernel_refuses_non_contiguous_input(backend):
    q, _, _, cache, meta = _inputs([(20, 1)], 16, 4, 2, 64, torch.float32, seed=1)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="contiguous"):
        backend.kernel(q, cache[:, :, :, :1], out, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_give_the_same_result(backend, threads):
    q, k, v, cache, meta = _inputs(SPECS["decodes and drafts"] * 4, 16, 4, 2, 64, torch.float32, seed=11)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(q, k, v, cache.clone(), meta, 0.125)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out.double(), _expected(q, k, v, cache, meta, 0.125), atol=2e-5, rtol=2e-5)


def test_tiles_shared_among_threads_give_identical_results(backend):
    """One long chunk's tiles, and the decodes around it, spread over threads: bit for bit what one
    thread computes (each tile writes only its own rows)."""
    q, k, v, cache, meta = _inputs(SPECS["long chunks among decodes"] + [(520, 513)], 16, 4, 2, 64,
                                   torch.float32, seed=12)
    backend.kernel.write_kv(k, v, cache, meta.slot_mapping)
    outs = []
    for threads in (1, 2, 3):
        out = torch.full_like(q, float("nan"))
        backend.kernel(q, cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, threads)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    torch.testing.assert_close(outs[0].double(), _expected(q, k, v, cache, meta, 0.125), atol=2e-5, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [[(300, 1)], [(40, 9)], [(90, 1), (33, 17)]])
def test_kv_heads_split_among_threads_give_identical_results(backend, dtype, specs):
    """A single decode (one tile) has its KV heads split among the threads, into as many ranges as
    the thread count asks (here 1 to 5 of 8 heads, uneven ranges included): bit for bit what one
    thread computes, and dense attention's values."""
    q, k, v, cache, meta = _inputs(specs, 16, 16, 8, 64, dtype, seed=13)
    backend.kernel.write_kv(k, v, cache, meta.slot_mapping)
    outs = []
    for threads in (1, 2, 3, 4, 5):
        out = torch.full_like(q, float("nan"))
        backend.kernel(q, cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125, threads)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    expected = dense_attention(q.double(), cache.double(), meta, 0.125, 16, 8)
    torch.testing.assert_close(outs[0].double(), expected, atol=tol, rtol=tol)


def test_selection(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    assert isinstance(select_backend("auto", cpu), CpuPagedAttention)
    assert isinstance(select_backend("cpu", cpu), CpuPagedAttention)
    assert type(select_backend("torch", cpu)) is TorchAttention
    # A machine with neither a compiler nor a prebuilt library (the package build's is skipped here).
    monkeypatch.setattr(kernel_build, "prebuilt_library",
                        lambda folder, flags=None: kernel_build.Prebuilt(None, "no prebuilt library here"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "empty"))
    assert type(select_backend("auto", cpu)) is TorchAttention  # warns, serves with torch
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        select_backend("cpu", cpu)
    with pytest.raises(ValueError, match="runs on the CPU"):
        select_backend("cpu", torch.device("meta"))


def test_empty_sequence_gets_zeros(backend):
    """A padding row of a fixed-size batch (seq_len 0, as CUDA-graph padding makes) attends to
    nothing: zeros, not the NaN of 0/0, and its neighbours are unaffected."""
    q, k, v, cache, meta = _inputs([(20, 1), (9, 1)], 16, 4, 2, 64, torch.float32, seed=2)
    expected = backend.forward(q, k, v, cache, meta, 0.125)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(q, float("nan"))
    backend.kernel(q, cache, out, meta.block_tables, seq_lens, meta.query_start_loc, 0.125, 1)
    assert (out[1] == 0).all()
    torch.testing.assert_close(out[0], expected[0])
