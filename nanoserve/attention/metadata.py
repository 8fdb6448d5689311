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
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import ArrayLike


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to read and write paged K/V for one step; made by `build`.

    Invariants: `query_start_loc[0] == 0`, `query_start_loc[-1] == num_tokens`; for every
    sequence `seq_lens[s] >= query_len(s) >= 1` (the new tokens are the last ones of the
    sequence), except the padding rows of a CUDA-graph batch (`seq_lens[s] == 0`, slot -1);
    `block_tables` rows cover at least `ceil(seq_lens[s] / block_size)` blocks. The `*_cpu`
    lists mirror the tensors so Python loops need no device sync.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64, always on the CPU (the C++ kernels read it)
    query_start_loc_device: torch.Tensor  # the same, on the device of the tensors above (the GPU kernels read it)
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int
    block_size: int

    @classmethod
    def build(cls, slot_mapping: ArrayLike, block_tables: ArrayLike, query_start_loc: ArrayLike,
              seq_lens: ArrayLike, num_decodes: int, block_size: int,
              device: torch.device | None = None) -> AttentionMetadata:
        """The metadata of flat host arrays (int64 numpy arrays, or what `np.asarray` makes one of),
        its tensors on `device` (default: the CPU, where they share memory with the arrays).
        `block_tables` is [num_seqs, max_blocks], padded."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        lens = np.asarray(seq_lens, dtype=np.int64)
        qsl_host = torch.from_numpy(qsl)
        return cls(
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device),
            block_tables=torch.from_numpy(np.asarray(block_tables, dtype=np.int64)).to(device),
            seq_lens=torch.from_numpy(lens).to(device), query_start_loc=qsl_host,
            query_start_loc_device=qsl_host.to(device), query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=lens.tolist(), num_decodes=num_decodes,
            block_size=block_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def head(self, n: int) -> AttentionMetadata:
        """The metadata of the first n sequences alone: views of these tensors, no copy."""
        end = self.query_start_loc_cpu[n]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:end], block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n],
            query_start_loc=self.query_start_loc[: n + 1], query_start_loc_device=self.query_start_loc_device[: n + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: n + 1],
            seq_lens_cpu=self.seq_lens_cpu[:n], num_decodes=min(self.num_decodes, n), block_size=self.block_size,
        )


class AttentionBackend(ABC):
    """Writes the new K/V of a step into the paged cache, then attends every query token to its
    sequence's cached keys (causally among the new tokens). Stateless between calls.

    `window` (a local layer's sliding window): the query at position p attends to the keys at
    positions p - window < j <= p only. The cache still holds every position (blocks that fell out
    of a window are not freed: the global layers of the same sequence read them)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
