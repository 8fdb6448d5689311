"""Rank 0 tells the worker ranks what to compute: the flat batch of each step, broadcast.

Rank 0 alone schedules, manages the KV blocks and samples; the workers only run the forward pass
over their shard on the batch rank 0 built (`prepare_batch`), writing K/V to the same block ids in
their own pool (every rank's pool has as many blocks, each with its share of the KV heads).

Wire format, all int64: first `Setup` (once: the pool's size), then per message a header of
`HEADER_LEN` values, [kind, num_tokens, num_seqs, table_width, num_logits_rows, num_decodes, 0, 0],
and for a step a payload in one tensor: input_ids, positions and slot_mapping (num_tokens each),
query_start_loc (num_seqs + 1), seq_lens (num_seqs), block_tables (num_seqs x table_width) and
the hidden-state rows whose logits rank 0 takes (num_logits_rows; -1 in the header: every row).
So a step costs two broadcasts, a fixed-size header then an exactly sized payload; a stop is a
header alone.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.engine.batch import PreparedBatch
from nanoserve.parallel.group import TensorParallelGroup

HEADER_LEN = 8


class Kind(enum.IntEnum):
    STOP = 0
    STEP = 1


class Setup(NamedTuple):
    """What a worker needs before its first step: the KV pool's size, and the context its model
    serves (`CausalLM.use_context`; 0: not set)."""

    num_blocks: int
    block_size: int
    context: int


class WorkerStep(NamedTuple):
    """One step's inputs as a worker receives them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor | slice


def send_setup(group: TensorParallelGroup, setup: Setup) -> None:
    group.broadcast(torch.tensor(setup, dtype=torch.int64, device=group.device))


def receive_setup(group: TensorParallelGroup) -> Setup:
    t = group.broadcast(torch.empty(len(Setup._fields), dtype=torch.int64, device=group.device))
    return Setup(*t.tolist())


def send_stop(group: TensorParallelGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=group.device)
    group.broadcast(header)


def send_step(group: TensorParallelGroup, batch: PreparedBatch) -> None:
    """Rank 0's side of one step: the header, then the payload."""
    meta = batch.meta
    rows = batch.logits_rows
    num_rows = -1 if isinstance(rows, slice) else rows.numel()
    header = [Kind.STEP, batch.num_tokens, meta.num_seqs, meta.block_tables.shape[1], num_rows, meta.num_decodes,
              0, 0]
    group.broadcast(torch.tensor(header, dtype=torch.int64, device=group.device))
    parts = [batch.input_ids, batch.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
             meta.block_tables.reshape(-1)]
    if not isinstance(rows, slice):
        parts.append(rows)
    group.broadcast(torch.cat([p.to(group.device) for p in parts]))


def receive_step(group: TensorParallelGroup, block_size: int) -> WorkerStep | None:
    """A worker's side: waits (without a time limit) for rank 0's next message; None for a stop."""
    header = group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=group.device), idle=True)
    kind, num_tokens, num_seqs, width, num_rows, num_decodes, _, _ = header.tolist()
    if kind == Kind.STOP:
        return None
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, max(num_rows, 0)]
    payload = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=group.device))
    ids, positions, slots, query_start_loc, seq_lens, tables, rows = payload.split(sizes)
    host = payload.cpu().split(sizes)  # query_start_loc also on the CPU, and the mirrors are host lists
    meta = AttentionMetadata(slots, tables.view(num_seqs, width), seq_lens, host[3], query_start_loc,
                             host[3].tolist(), host[4].tolist(), num_decodes, block_size)
    return WorkerStep(ids, positions, meta, slice(None) if num_rows < 0 else rows)
