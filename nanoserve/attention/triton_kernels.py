"""Triton kernels for paged attention: store K/V through the slot mapping, decode, prefill/extend.

Layouts (see `metadata`): `k_cache`/`v_cache` are `kv_cache[0]`/`kv_cache[1]`, each
`[num_blocks, block_size, num_kv_heads, head_dim]`; token position p of sequence s is at block
`block_tables[s, p // block_size]`, offset `p % block_size`. `q` is `[num_tokens, num_heads,
head_dim]` and `k`/`v` are `[num_tokens, num_kv_heads, head_dim]`; query head h reads KV head
`h // (num_heads // num_kv_heads)` (GQA). Every tensor's last dimension is contiguous; other strides
are passed in. Softmax runs in base 2: scores are multiplied by `scale * log2(e)` and exponentiated
with `exp2`, which gives the same probabilities.

The kernels walk a sequence's keys in tiles of BLOCK_N positions, gathering each position's block id
from the block table, so a tile may span several cache blocks or part of one: block_size is free of
the tile size, and any block_size works. Block-table entries past `seq_len` are never read.

Compilation: Triton compiles a kernel once per specialization of its arguments (an integer's being 1
or a multiple of 16, a pointer's 16-byte alignment). So the launchers pass whole tensors (a sub-batch
is named by an index argument, never by a slice, whose pointer alignment would vary), and every
integer that changes from step to step (the block-table width, the number of key splits, the first
sequence) is marked `do_not_specialize`: the store, split and prefill kernels compile once per model
and tile configuration, not once per batch shape. The merge kernel's tile follows the number of
splits (a power of two up to 16): a few variants, all compiled by the CUDA-graph capture (under
`--enforce-eager`, at first use), as the prefill kernel is by the engine's memory profile.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = math.log2(math.e)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_co, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Program t copies token t's K and V rows (all KV heads) to its slot; slot < 0 is skipped."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < NUM_KV_HEADS
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


@triton.jit
def _split_len(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Key positions per split: whole BLOCK_N tiles, the tiles of `seq_len` spread over `num_splits`.
    Split i covers `[i * len, min((i + 1) * len, seq_len))`; trailing splits may be empty."""
    return tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2) that every attention kernel here runs: folds the
    scores `qk` (`[rows, BLOCK_N]`, masked keys at -inf) and their values `v` (`[BLOCK_N, HEAD_DIM]`)
    into each row's running max `m_i`, sum of exponentials `l_i` and unnormalised output `acc` (fp32;
    the earlier tiles' share rescaled by `2**(old max - new max)`); returns the new `(m_i, l_i, acc)`.
    Start from -inf, 0, 0; each row's first tile needs a finite score (else -inf - -inf is NaN)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_splits,
    stride_qt, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Stage 1 of flash-decoding. Program (s, kvh, i) attends the GROUP query heads of KV head kvh
    (rows padded to BLOCK_H) of decode sequence s to the keys of split i, and writes the normalised
    partial output `part_o[s, h, i, :]` and its log2-sum-exp `part_lse[s, h, i]` (both fp32,
    contiguous `[num_decodes, num_heads, num_splits(, head_dim)]`). Empty splits write nothing."""
    s = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    split_len = _split_len(seq_len, num_splits, BLOCK_N)
    start = split * split_len
    if start >= seq_len:
        return
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + s * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        blk = tl.load(block_tables_ptr + s * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kvh * stride_ch
        k_t = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=valid[None, :], other=0.0)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    num_heads = tl.num_programs(1) * GROUP
    part = (s * num_heads + heads) * num_splits + split
    hmask = g < GROUP
    tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=hmask)
    tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=hmask[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Stage 2 of flash-decoding. Program (s, h) merges the non-empty splits of `part_o`/`part_lse`
    (weights `2**(lse_i - max lse)`) into `out[s, h, :]`. A sequence with seq_len 0 (padding of a
    CUDA-graph batch) has no non-empty split and gets zeros."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + s)
    i = tl.arange(0, BLOCK_S)
    used = (i < num_splits) & (i * _split_len(seq_len, num_splits, BLOCK_N) < seq_len)
    part = (s * tl.num_programs(1) + h) * num_splits + i
    lse = tl.load(part_lse_ptr + part, mask=used, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))  # 0 for unused splits, no inf - inf
    total = tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + s * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    qk_scale, first_seq,
    stride_qt, stride_qh, stride_cb, stride_co, stride_ch, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (i, h, j) computes query rows `[j * BLOCK_M, (j + 1) * BLOCK_M)` of the chunk of
    sequence `s = first_seq + i` for query head h: row r (position `ctx + r`, `ctx = seq_len -
    q_len`) attends cached positions `0..ctx + r`, with an online softmax over BLOCK_N-key tiles.
    The chunk's own K/V must already be in the cache. Programs past the chunk's end exit at once."""
    s = tl.program_id(0).to(tl.int64) + first_seq
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_ptr + s)
    q_len = tl.load(query_start_ptr + s + 1) - q_start
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx = seq_len - q_len
    kvh = h // GROUP

    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rmask[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Rows past q_len see keys 0..hi-1 (finite scores, never stored); key 0 is visible to every row.
    hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        blk = tl.load(block_tables_ptr + s * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
        row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kvh * stride_ch
        k_t = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=valid[None, :], other=0.0)
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        visible = valid[None, :] & (pos[None, :] <= (ctx + rows)[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton attention needs a power-of-two head_dim >= 16 (64, 128, ...), got {head_dim}")


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Validates shapes shared by the attention launchers; returns (block_size, GQA group size)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_head_dim(head_dim)
    if q.shape[1] % num_kv_heads or q.shape[2] != head_dim:
        raise ValueError(f"q of shape {tuple(q.shape)} does not fit a cache of {num_kv_heads} KV heads x {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need equal strides, and every last dimension must be contiguous")
    return block_size, q.shape[1] // num_kv_heads


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact dots ('ieee'), not TF32; 16-bit inputs are unaffected by the choice."""
    return "ieee" if dtype == torch.float32 else "tf32"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes `k[t]`, `v[t]` (`[num_tokens, num_kv_heads, head_dim]`) at flat slot `slot_mapping[t]`
    of the caches; tokens whose slot is negative (padding) are skipped. Grid: one program per token."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_head_dim(head_dim)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("store_kv needs contiguous last dimensions and equal k_cache/v_cache strides")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=k_cache.shape[1],
    )


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float, num_splits: int, block_n: int = 64) -> None:
    """Attends one query token per sequence (`q[s]`, `[num_seqs, num_heads, head_dim]`) to the first
    `seq_lens[s]` cached positions of `block_tables[s]`, writing `out[s]`. Flash-decoding: grid
    `(num_seqs, num_kv_heads, num_splits)` for the split pass, each split covering whole `block_n`
    tiles, then `(num_seqs, num_heads)` to merge. No host sync; a fixed `num_splits` keeps the launch
    shape fixed (CUDA-graph safe); padding rows with `seq_lens[s] == 0` get zeros."""
    block_size, group = _check_cache(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"need num_splits >= 1 and a power-of-two block_n >= 16, got {num_splits}, {block_n}")
    part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_heads // group, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_o, part_lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_o, part_lse, seq_lens, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(num_splits),
    )


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, out: torch.Tensor,
                  scale: float, block_m: int = 64, block_n: int = 64, first_seq: int = 0) -> None:
    """Attends chunks of query tokens, causally, to their sequences' cached keys, for sequences
    `first_seq..` of the tables. Sequence s owns rows `query_start[s]:query_start[s + 1]` of
    `q`/`out` (`[num_tokens, num_heads, head_dim]`), which are the last positions of its
    `seq_lens[s]`; `block_tables[s]` covers them all; `max_query_len` bounds those sequences' rows.
    Grid `(num_seqs - first_seq, num_heads, cdiv(max_query_len, block_m))`."""
    block_size, group = _check_cache(q, k_cache, v_cache)
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0:
        return
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    _prefill_kernel[(num_seqs, q.shape[1], triton.cdiv(max_query_len, block_m))](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out,
        scale * _LOG2E, first_seq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=q.shape[2], BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
