"""Sizing the KV pool from GPU memory (`--gpu-memory-utilization`), as vLLM's memory profiling does.

Before the pool exists, one forward pass over a full token budget (the largest step the scheduler
can plan: `max_num_batched_tokens` prompt tokens, in sequences of at most `max_model_len`, on a
scratch pool just large enough) measures the activations' peak. The pool then gets

    utilization x total memory - memory in use (weights, CUDA context, other processes) - that peak.

CUDA graphs captured afterwards take their (small) pool from the margin `1 - utilization` leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from nanoserve.engine.model_runner import KVShape, Model


def kv_budget_bytes(total: int, free: int, activation_peak: int, utilization: float) -> int:
    """Bytes the KV pool may take: `utilization * total - (total - free) - activation_peak`. Raises
    ValueError, with the numbers, when that leaves nothing."""
    budget = int(utilization * total) - (total - free) - activation_peak
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of {total / gib:.1f} GiB "
            f"is {utilization * total / gib:.1f} GiB, and {(total - free) / gib:.1f} GiB are in use (weights, "
            f"other processes) plus {activation_peak / gib:.2f} GiB of activations; raise gpu_memory_utilization, "
            "lower max_num_batched_tokens or free the GPU"
        )
    return budget


def _sequence_lens(num_tokens: int, max_model_len: int) -> list[int]:
    full, rest = divmod(num_tokens, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


def scratch_prefill(model: Model, kv_shape: KVShape, num_tokens: int, max_model_len: int, block_size: int,
                    backend: AttentionBackend, device: torch.device) -> torch.Tensor:
    """One forward pass of `num_tokens` prompt tokens (fresh sequences of at most `max_model_len`)
    on a scratch KV pool made for it and dropped after; returns the hidden states."""
    lens = _sequence_lens(num_tokens, max_model_len)
    blocks = [-(-n // block_size) for n in lens]
    pool = torch.zeros(kv_shape.num_layers, 2, sum(blocks), block_size, kv_shape.num_kv_heads, kv_shape.head_dim,
                       dtype=model.dtype, device=device)
    first = np.cumsum([0, *blocks])
    tables = np.zeros((len(lens), max(blocks)), dtype=np.int64)
    for row, (start, nb) in enumerate(zip(first, blocks, strict=False)):
        tables[row, :nb] = np.arange(start, start + nb)
    positions = np.concatenate([np.arange(n) for n in lens])
    slots = np.concatenate([first[i] * block_size + np.arange(n) for i, n in enumerate(lens)])
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(lens, device=device), query_start_loc_cpu=np.cumsum([0, *lens]).tolist(),
        seq_lens_cpu=lens, num_decodes=0, block_size=block_size,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return model(ids, torch.from_numpy(positions).to(device), pool, meta, backend)


def activation_peak_bytes(model: Model, kv_shape: KVShape, num_tokens: int, num_logits: int, max_model_len: int,
                          block_size: int, backend: AttentionBackend, device: torch.device) -> int:
    """CUDA bytes allocated at the peak of a `scratch_prefill` plus `num_logits` rows of logits,
    above what was allocated before it (the scratch pool excluded: it is sized for the test step,
    not the real pool)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = scratch_prefill(model, kv_shape, num_tokens, max_model_len, block_size, backend, device)
    model.compute_logits(hidden[: min(num_logits, num_tokens)])
    torch.cuda.synchronize(device)
    pool_bytes = kv_shape.bytes_per_block(block_size, model.dtype) * sum(
        -(-n // block_size) for n in _sequence_lens(num_tokens, max_model_len))
    peak = torch.cuda.max_memory_allocated(device) - before - pool_bytes
    del hidden
    torch.cuda.empty_cache()
    return max(peak, 0)
