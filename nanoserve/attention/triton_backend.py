"""Triton attention backend (the CUDA path): paged kernels that read K/V through block tables.

This module imports without triton; `triton_kernels` (which needs it) is imported when a
`TritonAttention` is built.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import torch

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.attention.torch_ref import TorchAttention


def _load_kernels() -> ModuleType:
    try:
        from nanoserve.attention import triton_kernels
    except ImportError as e:
        raise ImportError(
            "the triton attention backend needs the `triton` package (pip install triton); "
            "use --attention-backend torch without it"
        ) from e
    return triton_kernels


class TritonAttention(AttentionBackend):
    """store_kv, then the decode kernel for the first `meta.num_decodes` sequences and the prefill
    kernel for the rest, all on the same paged cache.

    `num_splits` fixes the number of key splits of a decode step; None picks one per step from the
    longest decode context (one split per `split_tokens` keys, at most `max_splits`). Fix it when
    capturing CUDA graphs, since the grid must not change between capture and replay. Tile sizes
    are powers of two >= 16 (the minimum of `tl.dot`).
    """

    def __init__(self, num_splits: int | None = None, max_splits: int = 16, split_tokens: int = 256,
                 decode_block_n: int = 64, prefill_block_m: int = 64, prefill_block_n: int = 64) -> None:
        self.kernels = _load_kernels()
        self.num_splits = num_splits
        self.max_splits = max_splits
        self.split_tokens = split_tokens
        self.decode_block_n = decode_block_n
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def decode_splits(self, meta: AttentionMetadata) -> int:
        """The number of key splits for this step's decode sequences."""
        if self.num_splits is not None:
            return self.num_splits
        longest = max(meta.seq_lens_cpu[: meta.num_decodes])
        return max(1, min(self.max_splits, -(-longest // self.split_tokens)))

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
        """A local layer's step (`window` set) goes through `TorchAttention` (the kernels have no
        window), whose steps are not graph-safe: the builder captures no CUDA graphs for models with
        local layers."""
        if window is not None:
            return TorchAttention().forward(q, k, v, kv_cache, meta, scale, window)
        kern = self.kernels
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kern.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            kern.paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], out[:nd], scale,
                              self.decode_splits(meta), block_n=self.decode_block_n)
        if nd < meta.num_seqs:
            max_query_len = max(b - a for a, b in itertools.pairwise(meta.query_start_loc_cpu[nd:]))
            kern.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc_device,
                               max_query_len, out, scale, block_m=self.prefill_block_m,
                               block_n=self.prefill_block_n, first_seq=nd)
        return out
