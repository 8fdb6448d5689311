"""Attention metadata for one flat, unpadded batch, and the backend interface.

A step's tokens from many sequences are concatenated. Sequences are ordered so that the first
`num_decodes` have exactly one query token each (decode steps, or a prefill whose only uncomputed
token is its last); the rest carry a chunk of several query tokens (prefill chunks).

Layout of the KV cache of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`; the
token at position p of a sequence lives in block `block_tables[s, p // block_size]` at offset
`p % block_size`, i.e. at flat slot `block * block_size + offset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to read and write paged K/V for one step.

    Invariants: `query_start_loc[0] == 0`, `query_start_loc[-1] == num_tokens`; for every
    sequence `seq_lens[s] >= query_len(s) >= 1` (the new tokens are the last ones of the
    sequence); `block_tables` rows cover at least `ceil(seq_lens[s] / block_size)` blocks.
    The `*_cpu` lists mirror the tensors so Python loops need no device sync.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    block_size: int
    # Derived once per step from query_start_loc_cpu (every layer's attention reads it):
    query_start_loc: torch.Tensor = field(init=False)  # [num_seqs + 1] int64, on the CPU

    def __post_init__(self) -> None:
        self.query_start_loc = torch.tensor(self.query_start_loc_cpu, dtype=torch.int64)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes the new K/V of a step into the paged cache, then attends every query token to its
    sequence's cached keys (causally among the new tokens). Stateless between calls."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
