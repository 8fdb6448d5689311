"""Sizing the KV pool from GPU memory (`--gpu-memory-utilization`), as vLLM's memory profiling does.

Before the pool exists, one forward pass over a full token budget (the largest step the scheduler
can plan: `max_num_batched_tokens` prompt tokens, in sequences of at most `max_model_len`, on a
scratch pool just large enough) measures the activations' peak. The pool then gets

    utilization x total memory - memory in use (weights, CUDA context, other processes) - that peak.

CUDA graphs captured afterwards take their (small) pool from the margin `1 - utilization` leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanoserve.attention import AttentionBackend
from nanoserve.engine.batch import prepare_batch
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.manager import BlockTable

if TYPE_CHECKING:
    from nanoserve.engine.model_protocol import KVShape, Model


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


def synthetic_plan(num_tokens: int, max_model_len: int, block_size: int) -> StepPlan:
    """The largest step of prompt tokens: `num_tokens` of them (all 0), in fresh sequences of at
    most `max_model_len` tokens, each in its own run of blocks of a scratch pool numbered from 0."""
    scheduled: list[tuple[Sequence, int]] = []
    first = 0
    for i, n in enumerate(_sequence_lens(num_tokens, max_model_len)):
        blocks = list(range(first, first + -(-n // block_size)))
        scheduled.append((Sequence(f"profile-{i}", [0] * n, SamplingParams(), arrival=i, table=BlockTable(blocks)), n))
        first += len(blocks)
    return StepPlan(scheduled)


def scratch_prefill(model: Model, kv_shape: KVShape, num_tokens: int, max_model_len: int, block_size: int,
                    backend: AttentionBackend, device: torch.device) -> torch.Tensor:
    """One forward pass of `synthetic_plan` on a scratch KV pool made for it and dropped after;
    returns the hidden states."""
    plan = synthetic_plan(num_tokens, max_model_len, block_size)
    num_blocks = sum(len(seq.table.blocks) for seq, _ in plan.scheduled)
    pool = torch.zeros(kv_shape.num_layers, 2, num_blocks, block_size, kv_shape.num_kv_heads, kv_shape.head_dim,
                       dtype=model.dtype, device=device)
    batch = prepare_batch(plan, block_size, device)
    return model(batch.input_ids, batch.positions, pool, batch.meta, backend)


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
