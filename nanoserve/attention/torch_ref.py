"""Reference attention backend in plain torch (the CPU path).

Decode sequences (one query token each) are attended in a few batched calls over their gathered,
padded block tables, in chunks of similar context length whose K/V stays in cache between the
gather and the attention. Sequences with a short query (at most `SHORT_QUERY_MAX` new tokens: a decode
step carrying speculative drafts, or a small prefill chunk) are attended likewise in one batched
call, their queries padded to the longest and masked causally with the cached prefix in front.
Longer prefill chunks are attended one sequence at a time. A local layer's window is one more
bound in each path's mask.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata

# Decodes are attended in chunks whose gathered K/V spans at most this many (padded) token slots:
# small enough to stay in cache between the gather and the attention that reads it.
DECODE_CHUNK_TOKENS = 4096
# Queries up to this many tokens take the batched padded path; longer ones the per-sequence loop.
SHORT_QUERY_MAX = 16


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores each new token's K and V at its flat slot (block * block_size + offset)."""
    _, _, _, kvh, d = kv_cache.shape
    kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, tables: torch.Tensor, nblk: int) -> torch.Tensor:
    """[n, kv_heads, nblk * block_size, head_dim]: the first `nblk` blocks of each table row."""
    _, bs, kvh, d = cache.shape
    # index_select, not cache[tables]: advanced indexing is much slower on CPU (docs/benchmarks.md,
    # "Batched vs one at a time on the demo model").
    flat = cache.index_select(0, tables[:, :nblk].flatten())
    return flat.view(tables.shape[0], nblk * bs, kvh, d).transpose(1, 2)


def _gather_kv(kv_cache: torch.Tensor, tables: torch.Tensor, nblk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_gather` of the K and the V half of one layer's cache in one index_select (one pass over
    the table instead of two, which is faster on CPU)."""
    _, nb, bs, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, nb, bs * kvh * d).index_select(1, tables[:, :nblk].flatten())
    kv = flat.view(2, tables.shape[0], nblk * bs, kvh, d).transpose(2, 3)
    return kv[0], kv[1]


def decode_chunks(seq_lens: list[int], block_size: int, budget: int) -> list[tuple[int, int]]:
    """Splits decode sequences 0..len(seq_lens) into consecutive ranges [a, b) whose gathered,
    padded K/V (rows x longest context, in whole blocks) stays within `budget` tokens, or holds a
    single sequence. Every sequence lands in exactly one range, in order; the split is cheapest when
    the sequences come sorted by length (`StepPlan` orders decodes so)."""
    chunks: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(seq_lens):
        padded = -(-n // block_size) * block_size
        if i > start and max(longest, padded) * (i - start + 1) > budget:
            chunks.append((start, i))
            start, longest = i, 0
        longest = max(longest, padded)
    if seq_lens:
        chunks.append((start, len(seq_lens)))
    return chunks


class TorchAttention(AttentionBackend):
    """Torch SDPA over gathered blocks. Padding slots are masked out, and the pool is zero-filled
    at allocation so padded reads never meet a NaN. Decodes go in chunks of at most
    `decode_chunk_tokens` gathered token slots (see `decode_chunks`)."""

    def __init__(self, decode_chunk_tokens: int = DECODE_CHUNK_TOKENS) -> None:
        self.decode_chunk_tokens = decode_chunk_tokens

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _, bs, kvh, d = k_cache.shape
        out = torch.empty_like(q)
        nd = meta.num_decodes
        group = q.shape[1] // kvh
        for a, b in decode_chunks(meta.seq_lens_cpu[:nd], bs, self.decode_chunk_tokens):
            nblk = -(-max(meta.seq_lens_cpu[a:b]) // bs)
            tables = meta.block_tables[a:b]
            keys = torch.arange(nblk * bs, device=q.device)
            mask = keys < meta.seq_lens[a:b, None]
            if window is not None:
                mask &= keys >= meta.seq_lens[a:b, None] - window
            # The query heads that share a KV head enter as that head's query rows (no GQA
            # expansion): one pass over each KV head's keys serves all of them.
            kd, vd = _gather_kv(kv_cache, tables, nblk)
            o = F.scaled_dot_product_attention(
                q[a:b].reshape(b - a, kvh, group, d), kd, vd, attn_mask=mask[:, None, None, :], scale=scale
            )
            out[a:b] = o.reshape(b - a, kvh * group, d)
        qsl = meta.query_start_loc_cpu
        short = [s for s in range(nd, meta.num_seqs) if qsl[s + 1] - qsl[s] <= SHORT_QUERY_MAX]
        if short:
            self._short_queries(q, k_cache, v_cache, meta, short, scale, out, window)
        long = [s for s in range(nd, meta.num_seqs) if qsl[s + 1] - qsl[s] > SHORT_QUERY_MAX]
        if long:
            self._attend_long(q, k_cache, v_cache, meta, long, scale, out, window)
        return out

    @staticmethod
    def _attend_long(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     seqs: list[int], scale: float, out: torch.Tensor, window: int | None = None) -> None:
        """Attends the queries of `seqs` one sequence at a time (one SDPA call over its gathered
        context each, causal among its new tokens) and writes the results into `out`."""
        qsl = meta.query_start_loc_cpu
        _, bs, kvh, d = k_cache.shape
        for s in seqs:
            start, end, seq_len = qsl[s], qsl[s + 1], meta.seq_lens_cpu[s]
            q_len = end - start
            nblk = -(-seq_len // bs)
            blocks = meta.block_tables[s, :nblk]
            ks = k_cache.index_select(0, blocks).view(-1, kvh, d)[:seq_len].transpose(0, 1)
            vs = v_cache.index_select(0, blocks).view(-1, kvh, d)[:seq_len].transpose(0, 1)
            mask = None
            if seq_len != q_len or (window is not None and window < seq_len):
                rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
                keys = torch.arange(seq_len, device=q.device)[None, :]
                mask = keys <= rows
                if window is not None:
                    mask &= keys > rows - window
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), ks, vs, attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)

    @staticmethod
    def _short_queries(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       seqs: list[int], scale: float, out: torch.Tensor, window: int | None = None) -> None:
        """Attends the queries of `seqs` in one call: each query padded to the longest by repeating
        its last token (whose result is dropped), and query i of sequence s attending to key
        positions <= seq_len - q_len + i. Writes the results into `out`. When `seqs` are consecutive
        and their queries equally long (every sequence carrying k drafts), nothing is padded and the
        queries are one slice of `q`."""
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        starts = np.asarray([qsl[s] for s in seqs], dtype=np.int64)
        q_lens = np.asarray([qsl[s + 1] for s in seqs], dtype=np.int64) - starts
        lens = np.asarray([seq_lens[s] for s in seqs], dtype=np.int64)
        n, width, heads, d = len(seqs), int(q_lens.max()), q.shape[1], q.shape[2]
        offset = np.minimum(np.arange(width), q_lens[:, None] - 1)  # [n, width], padding repeats the last
        key_limit = torch.from_numpy(lens[:, None] - q_lens[:, None] + offset).to(q.device)  # last visible key
        nblk = -(-int(lens.max()) // meta.block_size)
        keys = torch.arange(nblk * meta.block_size, device=q.device)
        mask = keys <= key_limit[:, :, None]
        if window is not None:
            mask &= keys > key_limit[:, :, None] - window
        uniform = seqs[-1] - seqs[0] == n - 1 and int(q_lens.min()) == width
        if uniform:
            tables = meta.block_tables[seqs[0] : seqs[-1] + 1]
            first, last = int(starts[0]), int(starts[-1]) + width
            qs = q[first:last].view(n, width, heads, d).transpose(1, 2)
        else:
            tables = meta.block_tables[torch.as_tensor(seqs, device=q.device)]
            rows = torch.from_numpy((starts[:, None] + offset).ravel()).to(q.device)
            qs = q.index_select(0, rows).view(n, width, heads, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qs, _gather(k_cache, tables, nblk), _gather(v_cache, tables, nblk), attn_mask=mask[:, None],
            scale=scale, enable_gqa=True,
        ).transpose(1, 2).reshape(n * width, heads, d)
        if uniform:
            out[first:last] = o
        else:
            valid = torch.from_numpy(np.flatnonzero(np.arange(width) < q_lens[:, None])).to(q.device)
            out.index_copy_(0, rows[valid], o[valid])
