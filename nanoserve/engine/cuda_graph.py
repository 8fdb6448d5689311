"""CUDA graphs for decode steps (the technique of vLLM's and SGLang's graph runners).

A small model's decode step is ~100 short kernels whose launch cost exceeds their run time; a
captured graph replays them all with one launch. Graphs fix shapes and addresses, so each is
captured for one batch size, over static input buffers, and a decode batch of n sequences runs the
graph of the smallest captured size >= n, its rows past n padded:

- padding rows have token 0 at position 0, slot -1 (the Triton store skips it, so no KV is written)
  and seq_len 0 (the decode kernel writes zeros for them); their logits are never read;
- the block-table buffer is as wide as `max_model_len` needs; entries past a row's seq_len are
  never read, so stale ones from earlier steps are harmless and only the live rows are copied.

Only decode steps (every sequence one token, at its end, no drafts) are captured; prefill and
verification steps run eagerly. The attention backend of a graph is a `TritonAttention` with a
fixed number of key splits (its launch grid must not change between capture and replay).

Off CUDA nothing is captured and `run` executes the same padded step eagerly: the CPU tests use
this, under the Triton interpreter, to check the padding and buffer logic against the plain path.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from nanoserve.attention import AttentionMetadata, TritonAttention

if TYPE_CHECKING:
    from nanoserve.engine.batch import PreparedBatch
    from nanoserve.engine.model_protocol import Model

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_batch_size: int) -> list[int]:
    """The ladder of batch sizes, ascending: 1, 2, 4, the multiples of 8, and last
    min(max_batch_size, MAX_CAPTURE_SIZE) itself. A batch is padded by at most 7 rows."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be at least 1")
    top = min(max_batch_size, MAX_CAPTURE_SIZE)
    return [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Key splits for a captured decode batch: enough (batch x KV head x split) programs to fill
    about two waves of the GPU's multiprocessors, at least 1 and at most `max_splits`. Each split's
    length follows the row's actual seq_len, so short contexts simply use fewer, shorter splits."""
    return max(1, min(max_splits, -(-2 * num_sms // (batch_size * num_kv_heads))))


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # the graph's output buffer, [batch_size, vocab] fp32


class DecodeGraphs:
    """Decode steps through static buffers, one CUDA graph per size of `capture_sizes`.

    Invariant between calls: every buffer row holds either the last batch's data or padding; `run`
    rewrites the first n rows and resets rows n..size-1 to padding before each replay.
    """

    def __init__(self, model: Model, kv_cache: torch.Tensor, num_kv_heads: int, max_batch_size: int,
                 max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sizes = capture_sizes(max_batch_size)
        top = self.sizes[-1]
        dev = self.device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        # Static buffers: a batch of `top` padding rows. Its host-side lists are placeholders: the
        # fixed-split Triton decode path reads only the tensors.
        self.meta = AttentionMetadata.build(
            slot_mapping=np.full(top, -1), block_tables=np.zeros((top, -(-max_model_len // block_size)), np.int64),
            query_start_loc=np.arange(top + 1), seq_lens=np.zeros(top, np.int64), num_decodes=top,
            block_size=block_size, device=dev,
        )
        # Off CUDA (the interpreter tests) a small stand-in still gives several splits per row.
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        self.backends = {size: TritonAttention(num_splits=decode_splits(size, num_kv_heads, num_sms))
                         for size in self.sizes}
        self._captured: dict[int, _Captured] = {}
        if dev.type == "cuda":
            self._capture()

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def fits(self, batch: PreparedBatch) -> bool:
        """True for a decode step a graph can run: every sequence has one query token, sampled at
        its end (so the logits rows are the sequences in order), and there are few enough."""
        n = batch.meta.num_seqs
        return batch.meta.num_decodes == n == len(batch.sampled) and n <= self.max_batch_size

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode step that `fits`. The result is a view of the graph's
        output buffer: read it before the next `run`."""
        n = meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        static = self.meta
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        static.slot_mapping[:n].copy_(meta.slot_mapping)
        static.seq_lens[:n].copy_(meta.seq_lens)
        static.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        static.slot_mapping[n:size].fill_(-1)
        static.seq_lens[n:size].zero_()
        captured = self._captured.get(size)
        if captured is None:  # off CUDA: the same padded step, eagerly
            return self._step(size)[:n]
        captured.graph.replay()
        return captured.logits[:n]

    def _step(self, size: int) -> torch.Tensor:
        """The captured computation: model forward and logits over the first `size` buffer rows."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self.meta.head(size),
                            self.backends[size])
        return self.model.compute_logits(hidden)

    def _capture(self) -> None:
        """Captures every size, largest first, into one shared memory pool. The buffers hold only
        padding meanwhile, so neither warm-up nor capture writes the KV cache."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._step(size)  # warm-up: compiles the Triton kernels and sets up cuBLAS outside capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._step(size)
                self._captured[size] = _Captured(graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s", len(self.sizes),
                 self.max_batch_size, time.perf_counter() - start)
