"""The batch builder: a `StepPlan` in, one flat, unpadded batch (`PreparedBatch`) out.

Every forward pass goes through here: the runner's steps, the draft model's passes, the decode
batches the CUDA graphs copy into their static buffers and the memory profile's synthetic step.
The batch keeps the plan's order (decodes first, shortest context first: see `StepPlan`).

This is on the per-step path: the index math runs in numpy, whose calls cost less than torch's CPU
dispatch, and the arrays become tensors through `torch.from_numpy` (never `torch.tensor` of a list).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.engine.pooling import PoolSpan
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.sequence import Sequence


class PreparedBatch(NamedTuple):
    """One step's model inputs, and which hidden-state rows become logits for whom.

    `logits_rows` lists, first, the last token of each sequence of `sampled` (plain sequences whose
    step reaches their last token), in order; then, for each sequence of `verified` (those carrying
    drafts), its last token and every draft. A prefill chunk that stops short of the prompt's end
    has no row. Last come the prompt rows: for each (sequence, first, count) of `prompt_rows`
    (sequences whose prompt logprobs are wanted), the positions first .. first + count - 1 of its
    prompt, each of which predicts the prompt token after it. When that is every row in order (a
    step of decodes and verifications only), it is `slice(None)`, so the logits need no gather.
    Pooling sequences (`SamplingParams.pooling`) have no logits row: their rows are listed in
    `pooled`, one span per such sequence in the step, whether or not it reaches its prompt's end.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor | slice
    sampled: list[Sequence]
    verified: list[Sequence]
    prompt_rows: tuple[tuple[Sequence, int, int], ...] = ()
    pooled: tuple[PoolSpan, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def prepare_batch(plan: StepPlan, block_size: int, device: torch.device) -> PreparedBatch:
    """The plan's new tokens, positions and attention metadata, on `device`. A sequence with a
    draft is scheduled with its last token and every draft (the scheduler's invariant)."""
    ids: list[int] = []
    starts: list[int] = []
    query_lens: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    sampled: list[Sequence] = []
    verify_rows: list[int] = []
    verified: list[Sequence] = []
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[Sequence, int, int]] = []
    pooled: list[PoolSpan] = []
    for seq, n in plan.scheduled:
        start = seq.num_computed_tokens
        row = len(ids)
        starts.append(start)
        query_lens.append(n)
        tables.append(seq.table.blocks)
        if seq.params.pooling is not None:
            ids += seq.all_token_ids[start : start + n]
            pooled.append(PoolSpan(seq, row, start, n))
        elif seq.draft is None:
            ids += seq.all_token_ids[start : start + n]
            if start + n == len(seq.all_token_ids):
                sample_rows.append(row + n - 1)
                sampled.append(seq)
            if seq.needs_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                count = min(start + n, seq.num_prompt_tokens - 1) - start
                prompt_rows += range(row, row + count)
                prompt_spans.append((seq, start, count))
        else:
            ids += seq.all_token_ids[start:]
            ids += seq.draft.tokens
            verify_rows += range(row, row + n)
            verified.append(seq)
    num_seqs, num_tokens = len(starts), len(ids)
    start_arr = np.array(starts, dtype=np.int64)
    if num_tokens == num_seqs:  # one token each: positions are the starts
        seq_of_token = np.arange(num_seqs)
        query_start = np.arange(num_seqs + 1)
        positions = start_arr
        seq_lens = start_arr + 1
    else:
        len_arr = np.array(query_lens, dtype=np.int64)
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(len_arr, out=query_start[1:])
        seq_of_token = np.repeat(np.arange(num_seqs), len_arr)
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - start_arr, len_arr)
        seq_lens = start_arr + len_arr
    block_tables = np.zeros((num_seqs, max(map(len, tables))), dtype=np.int64)  # padded with 0
    for s, table in enumerate(tables):  # row by row: fewer numpy calls than a masked fill for small batches
        block_tables[s, : len(table)] = table
    block, offset = np.divmod(positions, block_size)
    slots = block_tables[seq_of_token, block] * block_size + offset
    meta = AttentionMetadata.build(slots, block_tables, query_start, seq_lens, query_lens.count(1), block_size,
                                   device)
    rows = sample_rows + verify_rows + prompt_rows
    logits_rows: torch.Tensor | slice = slice(None)  # every row: decodes (first) and verifications, in order
    if len(rows) < num_tokens or prompt_rows or pooled:
        logits_rows = torch.from_numpy(np.array(rows, dtype=np.int64)).to(device)
    return PreparedBatch(torch.from_numpy(np.array(ids, dtype=np.int64)).to(device),
                         torch.from_numpy(positions).to(device), meta, logits_rows, sampled, verified,
                         tuple(prompt_spans), tuple(pooled))
