"""The CPU attention backend: a C++ paged-attention kernel for every query, decode or prefill chunk.

`TorchAttention` gathers each sequence's blocks into a padded copy before attending; at many decodes
of a few hundred tokens that copy and SDPA's padded pass are a large part of a step, and for prefill
chunks torch takes SDPA's math path over a materialised score matrix. The kernel in
`nanoserve/csrc/paged_attention.cpp` reads K and V straight from the block pool, once per KV head
for all the query heads that share it, with an online softmax. It cuts each sequence's new tokens
into tiles of up to 16 tokens (a decode, or one with up to 15 drafts, is one tile), walks for each
tile only the blocks its last token can see, and shares the tiles of all sequences among the torch
threads; each query row's arithmetic is the same whatever the tiling.

The kernel is part of the library that `nanoserve.native` compiles on first use; where no compiler
works, `load_paged_attention` returns None and 'auto' selects `TorchAttention`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_ref import TorchAttention
from nanoserve.native import DTYPE_SUFFIX, load_cpu_kernels

HEAD_DIMS = frozenset((32, 64, 128, 256))  # compiled into the kernel


class PagedAttentionKernel:
    """The loaded kernel and its K/V write. Invariant: only CPU tensors of one supported dtype and
    a head size in HEAD_DIMS, laid out as `nanoserve/csrc/paged_attention.cpp` states (checked
    here: q, k and v may have their tokens any distance apart, everything else is contiguous), reach
    the library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attend = {dtype: getattr(lib, f"nanoserve_paged_attention_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._write = {dtype: getattr(lib, f"nanoserve_write_kv_{s}") for dtype, s in DTYPE_SUFFIX.items()}

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._attend and head_dim in HEAD_DIMS

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float, num_threads: int) -> None:
        """Writes into `out` the attention of every sequence's query rows, reading K and V from
        `kv_cache` (see the source), on `num_threads` threads."""
        indices = (block_tables, seq_lens, query_start)
        if not (_token_rows(q) and all(t.is_contiguous() for t in (kv_cache, out, *indices))):
            raise ValueError("the paged-attention kernel reads raw memory: q's heads and every other tensor must "
                             "be contiguous")
        if not all(t.dtype == torch.int64 for t in indices):
            raise ValueError("block tables, sequence lengths and offsets must be int64")
        _, nb, bs, kvh, d = kv_cache.shape
        ran = self._attend[q.dtype](
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), query_start.data_ptr(), seq_lens.shape[0], q.shape[1], kvh,
            d, bs, nb, scale, num_threads,
        )
        if not ran:
            raise ValueError(f"the paged-attention kernel has no build for head size {d}")

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores each new token's K and V at its flat slot (block * block_size + offset), as
        `torch_ref.write_kv` does; raises IndexError, having written nothing, for a slot outside the pool."""
        if not (_token_rows(k) and _token_rows(v) and kv_cache.is_contiguous() and slot_mapping.is_contiguous()
                and slot_mapping.dtype == torch.int64 and k.dtype == v.dtype == kv_cache.dtype):
            raise ValueError("write_kv: k and v need contiguous heads, the cache and slots contiguous int64")
        _, nb, bs, kvh, d = kv_cache.shape
        if not self._write[k.dtype](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(),
                                    slot_mapping.data_ptr(), k.shape[0], kvh * d, nb * bs):
            raise IndexError(f"write_kv: a slot outside the pool of {nb * bs} slots")


def _token_rows(x: torch.Tensor) -> bool:
    """x [tokens, heads, head_dim] has contiguous heads; its tokens may be any distance apart."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def load_paged_attention(cache_dir: Path | None = None) -> PagedAttentionKernel | None:
    """The kernel from nanoserve's CPU kernel library (built first if needed); None (with a
    warning) when the library cannot be built or loaded."""
    lib = load_cpu_kernels(cache_dir)
    return None if lib is None else PagedAttentionKernel(lib)


class CpuPagedAttention(TorchAttention):
    """Every query, whatever its length, through `PagedAttentionKernel` in one call per layer;
    anything the kernel does not take (a dtype other than fp32/bf16, a head size it has no build
    for, a non-CPU tensor, a local layer's step in which some sequence is longer than the window:
    the kernel has no window), through `TorchAttention`."""

    def __init__(self, kernel: PagedAttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel

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
        if (q.device.type != "cpu" or not self.kernel.supports(q.dtype, q.shape[2]) or kv_cache.dtype != q.dtype
                or (window is not None and max(meta.seq_lens_cpu, default=0) > window)):
            return super().forward(q, k, v, kv_cache, meta, scale, window)
        self.kernel.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        self.kernel(q, kv_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                    torch.get_num_threads())
        return out
