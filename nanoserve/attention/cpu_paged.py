"""The CPU attention backend: a C++ paged-attention kernel for decodes and short queries.

`TorchAttention` gathers each sequence's blocks into a padded copy before attending; at 64 decodes
of a few hundred tokens that copy and SDPA's padded pass are about 40% of a step. The kernel in
`nanoserve/csrc/paged_attention.cpp` reads K and V straight from the block pool, once per KV head
for all the query heads and new tokens that share it, with an online softmax. Longer prefill chunks (more than
`SHORT_QUERY_MAX` new tokens) still go through `TorchAttention`'s per-sequence SDPA, whose blocked
GEMMs suit long queries better.

The kernel is part of the library that `nanoserve.native` compiles on first use; where no compiler
works, `load_paged_attention` returns None and 'auto' selects `TorchAttention`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_ref import SHORT_QUERY_MAX, TorchAttention, write_kv
from nanoserve.native import load_cpu_kernels

HEAD_DIMS = frozenset((32, 64, 128, 256))  # compiled into the kernel
_SUPPORTED = {torch.float32: "nanoserve_paged_attention_f32", torch.bfloat16: "nanoserve_paged_attention_bf16"}


class PagedAttentionKernel:
    """The loaded kernel. Invariant: `__call__` only sees CPU tensors of one supported dtype and a
    head size in HEAD_DIMS, laid out as `nanoserve/csrc/paged_attention.cpp` states."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fns = {}
        for dtype, name in _SUPPORTED.items():
            fn = getattr(lib, name)
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                           ctypes.c_int]
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._fns and head_dim in HEAD_DIMS

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start: torch.Tensor, seq_ids: torch.Tensor, scale: float,
                 num_threads: int) -> None:
        """Writes into `out` the attention of the listed sequences' query rows (see the source)."""
        tensors = (q, kv_cache, out, block_tables, seq_lens, query_start, seq_ids)
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("the paged-attention kernel reads raw memory: every tensor must be contiguous")
        if not all(t.dtype == torch.int64 for t in tensors[3:]):
            raise ValueError("block tables, sequence lengths and offsets must be int64")
        _, nb, bs, kvh, d = kv_cache.shape
        ran = self._fns[q.dtype](
            q.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            seq_lens.data_ptr(), query_start.data_ptr(), seq_ids.data_ptr(), seq_ids.shape[0], q.shape[1], kvh, d,
            bs, nb, scale, num_threads,
        )
        if not ran:
            raise ValueError(f"the paged-attention kernel has no build for head size {d}")


def load_paged_attention(cache_dir: Path | None = None) -> PagedAttentionKernel | None:
    """The kernel from nanoserve's CPU kernel library (built first if needed); None (with a
    warning) when the library cannot be built or loaded."""
    lib = load_cpu_kernels(cache_dir)
    return None if lib is None else PagedAttentionKernel(lib)


class CpuPagedAttention(TorchAttention):
    """Decodes and short queries through `PagedAttentionKernel`; longer prefill chunks, and
    anything the kernel does not take (a dtype other than fp32/bf16, a head size it has no build
    for, a non-CPU tensor), through `TorchAttention`."""

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
    ) -> torch.Tensor:
        if q.device.type != "cpu" or not self.kernel.supports(q.dtype, q.shape[2]) or kv_cache.dtype != q.dtype:
            return super().forward(q, k, v, kv_cache, meta, scale)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        short, long = [], []
        for s in range(meta.num_seqs):
            (short if qsl[s + 1] - qsl[s] <= SHORT_QUERY_MAX else long).append(s)
        if short:
            self.kernel(q, kv_cache, out, meta.block_tables, meta.seq_lens,
                        torch.from_numpy(np.asarray(qsl, dtype=np.int64)), torch.tensor(short, dtype=torch.int64),
                        scale, torch.get_num_threads())
        if long:
            self._attend_long(q, kv_cache[0], kv_cache[1], meta, long, scale, out)
        return out
