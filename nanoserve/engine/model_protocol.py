"""What the engine needs of a model (`Model`: `CausalLM`, or a stand-in in tests and benchmarks)
and the shape of its KV cache (`KVShape`). The runner, the CUDA graphs and the memory profile all
take a model through this protocol, so none of them imports another to name it."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata


class Model(Protocol):
    """What the runner needs of a model (CausalLM, or a stand-in in tests and benchmarks)."""

    dtype: torch.dtype

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class KVShape(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize
