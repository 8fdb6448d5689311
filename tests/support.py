"""Test helpers shared by several test files: a bare forward pass over whole sequences."""

from __future__ import annotations

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
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=block_tables[active], seq_lens=torch.tensor(lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens, num_decodes=0, block_size=BLOCK_SIZE,
        )
        hidden = model(torch.tensor(ids), torch.tensor(pos), kv, meta, TorchAttention())
        logits = model.compute_logits(hidden)
        for j, s in enumerate(active):
            out[s].append(logits[qsl[j] : qsl[j + 1]])
    return [torch.cat(o) for o in out]


def full_logits(loaded: LoadedModel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len, vocab] for every position of each sequence, from one batched prefill."""
    return forward_chunks(loaded, [[s] for s in seqs])
