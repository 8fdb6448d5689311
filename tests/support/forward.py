"""Test helpers shared by several test files: a bare forward pass over whole sequences, and paged
attention metadata with its dense reference."""

from __future__ import annotations

import random

import torch

from nanoserve.attention import AttentionMetadata, TorchAttention
from nanoserve.model import LoadedModel

BLOCK_SIZE = 8


def forward_chunks(loaded: LoadedModel, chunks: list[list[list[int]]]) -> list[torch.Tensor]:
    """Runs each sequence through the model in the given chunks (one forward pass per chunk index,
    all sequences batched flat), each sequence in its own contiguous run of blocks. Returns the
    logits of every position of every sequence, concatenated over chunks."""
    cfg, model = loaded.config, loaded.model
    lengths = [sum(len(c) for c in seq) for seq in chunks]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in lengths]
    kv = torch.zeros(cfg.num_hidden_layers, 2, sum(blocks_per_seq), BLOCK_SIZE, cfg.num_key_value_heads,
                     cfg.head_dim, dtype=model.dtype)
    tables, first = [], 0
    for n in blocks_per_seq:
        tables.append(list(range(first, first + n)))
        first += n
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    done = [0] * len(chunks)
    out: list[list[torch.Tensor]] = [[] for _ in chunks]
    for step in range(max(len(c) for c in chunks)):
        active = [s for s, c in enumerate(chunks) if step < len(c)]
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for s in active:
            toks = chunks[s][step]
            for i, t in enumerate(toks):
                p = done[s] + i
                ids.append(t)
                pos.append(p)
                slots.append(tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            done[s] += len(toks)
            qsl.append(qsl[-1] + len(toks))
            lens.append(done[s])
        meta = AttentionMetadata.build(slots, block_tables[active].numpy(), qsl, lens, num_decodes=0,
                                       block_size=BLOCK_SIZE)
        hidden = model(torch.tensor(ids), torch.tensor(pos), kv, meta, TorchAttention())
        logits = model.compute_logits(hidden)
        for j, s in enumerate(active):
            out[s].append(logits[qsl[j] : qsl[j + 1]])
    return [torch.cat(o) for o in out]


def full_logits(loaded: LoadedModel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len, vocab] for every position of each sequence, from one batched prefill."""
    return forward_chunks(loaded, [[s] for s in seqs])


def paged_batch(specs: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
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
    return AttentionMetadata.build(
        slots, [t + [0] * (width - len(t)) for t in tables], qsl, seq_lens,
        num_decodes=next((i for i, (_, q) in enumerate(specs) if q > 1), len(specs)), block_size=block_size,
    )


def dense_attention(q, cache, meta, scale, num_heads, num_kv_heads, window=None):
    """Each sequence's queries against its keys, by the formula: softmax(q k^T * scale) v with key
    p visible to query i iff p <= seq_len - q_len + i (and, with a window, p > that - window)."""
    out = torch.empty_like(q)
    bs = meta.block_size
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[s], meta.query_start_loc_cpu[s + 1]
        slots = [int(meta.block_tables[s, p // bs]) * bs + p % bs for p in range(seq_len)]
        keys = cache[0].flatten(0, 1)[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = cache[1].flatten(0, 1)[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], keys) * scale
        last = torch.arange(end - start)[:, None] + seq_len - (end - start)
        visible = torch.arange(seq_len)[None, :] <= last
        if window is not None:
            visible &= torch.arange(seq_len)[None, :] > last - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out
