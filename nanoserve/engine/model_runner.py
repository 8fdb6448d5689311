"""Model runner: a StepPlan in, one flat batch through the model, sampled tokens out.

Owns the KV cache tensor (one pool for all layers), the attention backend, the sampler and the
per-request random generators of seeded requests. A step runs through the model's Python forward,
a captured CUDA graph (`cuda_graph`), or on the CPU the whole decoder in one native call
(`nanoserve.model.native_decoder`), whichever applies; all give the same hidden states.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Protocol

import numpy as np
import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata, TorchAttention
from nanoserve.engine.cuda_graph import DecodeGraphs
from nanoserve.engine.request import Request
from nanoserve.engine.sampler import Sampler, SamplerOutput, SamplingBatch, sampling_probs
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.spec_decode import verify, verify_greedy
from nanoserve.model.decoder import CausalLM
from nanoserve.model.native_decoder import NativeDecoder


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


class StepResult(NamedTuple):
    """What the step produced: `sampled` holds one token per sequence of `requests` (those that
    reached their last token without drafts); `verified` the kept tokens (accepted drafts + one)
    of each sequence whose drafts were verified."""

    requests: list[Request]
    sampled: SamplerOutput
    verified: list[tuple[Request, list[int]]]


def _decodes_by_length(scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """The plan's sequences with the single-token ones (decodes) first, shortest context first,
    and the multi-token ones after them in plan order: attention backends batch decodes of
    similar length together (torch_ref's chunks), so less of each gather is padding."""
    return sorted(scheduled, key=lambda item: (item[1] > 1, item[0].num_computed_tokens if item[1] == 1 else 0))


class ModelRunner:
    def __init__(self, model: Model, kv_shape: KVShape, num_blocks: int, block_size: int, vocab_size: int,
                 stop_token_ids: frozenset[int], device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.backend = backend or TorchAttention()
        self.sampler = Sampler()
        # Zero-filled: padded block-table reads are masked, and a zero never turns into NaN.
        self.kv_cache = torch.zeros(kv_shape.num_layers, 2, num_blocks, block_size, kv_shape.num_kv_heads,
                                    kv_shape.head_dim, dtype=model.dtype, device=device)
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self.decode_graphs: DecodeGraphs | None = None  # set by `use_decode_graphs`
        # Steps whose products all run in C++ anyway go through the decoder in one native call.
        self.native = NativeDecoder.build(model, self.backend) if isinstance(model, CausalLM) else None

    def use_decode_graphs(self, num_kv_heads: int, max_batch_size: int, max_model_len: int) -> None:
        """Runs decode steps of up to `max_batch_size` sequences through CUDA graphs (see
        `cuda_graph`), captured now on CUDA; off CUDA the same padded path runs eagerly."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, num_kv_heads, max_batch_size, max_model_len,
                                          self.block_size)

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[Request], list[Request]]:
        """One forward pass over the plan: logits at the rows to sample (see `_prepare`), the plain
        sequences that reached their end, and the sequences with drafts."""
        meta, input_ids, positions, sample_rows, sample_reqs, spec_reqs = self._prepare(plan)
        if self.decode_graphs is not None and self.decode_graphs.fits(meta, len(sample_reqs)):
            return self.decode_graphs.run(input_ids, positions, meta), sample_reqs, spec_reqs
        if self.native is not None and self.native.fits(input_ids.shape[0]):
            hidden = self.native(input_ids, positions, self.kv_cache, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend)
        return self.model.compute_logits(hidden[sample_rows]), sample_reqs, spec_reqs

    def draft_greedy(self, plan: StepPlan, budgets: dict[Request, int],
                     min_confidence: float) -> dict[Request, list[int]] | None:
        """Greedy drafts for every sequence of `plan` (each ends its step at its last token) in one
        native call (`NativeDecoder.draft_greedy`: the step, then a pass per further draft, up to
        `budgets[seq]` drafts, stopping after one given less than `min_confidence`); None when the
        native decoder does not take the step, and the caller drafts pass by pass."""
        if self.native is None or not self.native.fits(plan.num_tokens):
            return None
        meta, input_ids, positions, _, seqs, _ = self._prepare(plan)
        drafts = self.native.draft_greedy(input_ids, positions, self.kv_cache, meta, [budgets[s] for s in seqs],
                                          min_confidence, self.vocab_size)
        return dict(zip(seqs, drafts, strict=True))

    def execute(self, plan: StepPlan) -> StepResult:
        logits, sample_reqs, spec_reqs = self.forward(plan)
        sampled = SamplerOutput([], None, None)
        if sample_reqs:
            sampled = self.sampler(logits[: len(sample_reqs)], self._sampling_batch(sample_reqs))
        return StepResult(sample_reqs, sampled, self._verify(logits[len(sample_reqs) :], spec_reqs))

    def _verify(self, logits: torch.Tensor, spec_reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        """The kept tokens of each sequence with drafts; `logits` holds its last token's row and one
        row per draft, sequence after sequence. Greedy sequences share one argmax over all rows;
        sampled ones one `sampling_probs` and one batched `verify`."""
        kept: dict[Request, list[int]] = {}
        greedy: list[tuple[Request, int]] = []  # (sequence, its first row)
        sampled_rows: list[int] = []
        sampled: list[Request] = []
        row = 0
        for req in spec_reqs:
            k = len(req.spec_token_ids)
            if req.params.greedy:
                greedy.append((req, row))
            else:
                sampled_rows.extend(range(row, row + k + 1))
                sampled.append(req)
            row += k + 1
        if greedy:
            argmax = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for req, row in greedy:
                kept[req] = verify_greedy(argmax[row : row + len(req.spec_token_ids) + 1], req.spec_token_ids)
        if sampled:
            params = [r.params for r in sampled for _ in range(len(r.spec_token_ids) + 1)]
            targets = sampling_probs(logits[sampled_rows], params, self.vocab_size)
            outs = verify(targets, [r.spec_token_ids for r in sampled], [r.spec_probs for r in sampled],
                          [self._generator(r) for r in sampled])
            kept.update(zip(sampled, outs, strict=True))
        return [(req, kept[req]) for req in spec_reqs]

    def release(self, req: Request) -> None:
        """Forgets a finished request's generator."""
        self._generators.pop(req.key, None)

    def _prepare(self, plan: StepPlan) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 list[Request], list[Request]]:
        """Flat batch tensors, decodes first in order of context length (see `_decodes_by_length`).
        Logits rows: first the last token of each plain sequence that reaches its end, then, per
        sequence with drafts, its last token and every draft."""
        bs = self.block_size
        ids: list[int] = []
        starts: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        spec_rows: list[int] = []
        spec_reqs: list[Request] = []
        for req, n in _decodes_by_length(plan.scheduled):
            start = req.num_computed_tokens
            end = start + n
            ids.extend(req.all_token_ids[start:end])
            starts.append(start)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(req.table.blocks)
            if end > req.num_tokens:  # the last token and drafts
                ids.extend(req.spec_token_ids)
                spec_rows.extend(range(qsl[-1] - n, qsl[-1]))
                spec_reqs.append(req)
            elif end == req.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                sample_reqs.append(req)
        dev = self.device
        # Index math in numpy: a few microseconds per op where torch's CPU dispatch costs tens.
        table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        block_tables = np.zeros((len(tables), table_lens.max()), dtype=np.int64)  # padded with 0
        block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int64, count=table_lens.sum())
        q_start = np.asarray(qsl, dtype=np.int64)
        q_lens = np.diff(q_start)
        rows = np.repeat(np.arange(len(tables)), q_lens)
        positions = np.arange(len(ids)) - np.repeat(q_start[:-1] - np.asarray(starts, dtype=np.int64), q_lens)
        slots = block_tables[rows, positions // bs] * bs + positions % bs
        positions = torch.from_numpy(positions)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.tensor(seq_lens, device=dev), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            num_decodes=plan.num_decodes, block_size=bs,
        )
        return (meta, torch.tensor(ids, device=dev), positions.to(dev),
                torch.tensor(sample_rows + spec_rows, dtype=torch.long, device=dev), sample_reqs, spec_reqs)

    def _generator(self, req: Request) -> torch.Generator | None:
        """The request's own generator when it is seeded and samples (created on first use)."""
        p = req.params
        if p.seed is None or p.greedy:
            return None
        gen = self._generators.get(req.key)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed((p.seed + req.index) % 2**64)
            self._generators[req.key] = gen
        return gen

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        generators: list[torch.Generator | None] = []
        suppressed: list[frozenset[int]] = []
        for req in reqs:
            p = req.params
            generators.append(self._generator(req))
            if req.num_output_tokens < p.min_tokens:
                eos = frozenset() if p.ignore_eos else self.stop_token_ids
                suppressed.append(eos | frozenset(p.stop_token_ids))
            else:
                suppressed.append(frozenset())
        return SamplingBatch.build(
            [r.params for r in reqs], [r.output_token_ids for r in reqs], [r.prompt_token_ids for r in reqs],
            generators, self.vocab_size, self.device, suppressed,
        )
