"""Model runner: a StepPlan in, one flat batch through the model, sampled tokens out.

Owns the KV cache tensor (one pool for all layers), the attention backend, the sampler and the
per-request random generators of seeded requests. A step runs through the model's Python forward,
a captured CUDA graph (`cuda_graph`), or on the CPU the whole decoder in one native call
(`nanoserve.model.native_decoder`), whichever applies; all give the same hidden states. The
hidden states of pooling sequences' rows go to the `Pooler` (never through a CUDA graph, which
returns logits only).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from nanoserve.attention import AttentionBackend, TorchAttention
from nanoserve.engine.batch import PreparedBatch, prepare_batch
from nanoserve.engine.cuda_graph import DecodeGraphs
from nanoserve.engine.kv_memory import zeroed_pool
from nanoserve.engine.model_protocol import KVShape, Model
from nanoserve.engine.outputs import PromptLogprob
from nanoserve.engine.pooling import Pooled, Pooler
from nanoserve.engine.sampler import Sampler, SamplerOutput, SamplingBatch, sampling_probs
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode import Proposal, verify, verify_greedy
from nanoserve.engine.structured import GrammarCompiler, unpack_bitmask
from nanoserve.model.decoder import CausalLM
from nanoserve.model.native_decoder import NativeDecoder


class RunnerFailure(RuntimeError):
    """The runner can run no further step (a tensor-parallel rank is lost): the engine is dead."""


class StepResult(NamedTuple):
    """What the step produced: `sampled` holds one token per sequence of `sequences` (those that
    reached their last token without drafts); `verified` the kept tokens (accepted drafts + one)
    of each sequence whose drafts were verified; `prompt_logprobs` per (sequence, first position)
    the logprobs of its prompt tokens first + 1, first + 2, ... computed in this step; `pooled` the
    embedding of each pooling sequence whose prompt ended in this step; `expert_load` a mixture
    of experts' tokens per expert per MoE layer in this step (`CausalLM.take_expert_load`; None
    for a dense model)."""

    sequences: list[Sequence]
    sampled: SamplerOutput
    verified: list[tuple[Sequence, list[int]]]
    prompt_logprobs: tuple[tuple[Sequence, int, list[PromptLogprob]], ...] = ()
    pooled: Pooled = ()
    expert_load: torch.Tensor | None = None


def _proposal(seq: Sequence) -> Proposal:
    """The draft a sequence carries, as every proposer makes it."""
    assert isinstance(seq.draft, Proposal), "drafts come from a Proposer"
    return seq.draft


class ModelRunner:
    """Runs steps. `grammars` (set by the engine when it serves structured output) fills the masks
    of constrained sequences; they are computed on a worker thread while the forward pass runs."""

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
        self.pooler = Pooler()
        # Zero-filled: padded block-table reads are masked, and a zero never turns into NaN.
        self.kv_cache = zeroed_pool((kv_shape.num_layers, 2, num_blocks, block_size, kv_shape.num_kv_heads,
                                     kv_shape.head_dim), model.dtype, device)
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self.decode_graphs: DecodeGraphs | None = None  # set by `use_decode_graphs`
        # On the CPU path every step of a model NativeDecoder takes goes through it in one native call.
        self.native = NativeDecoder.build(model, self.backend) if isinstance(model, CausalLM) else None
        self.grammars: GrammarCompiler | None = None
        self._mask_worker: ThreadPoolExecutor | None = None  # created with the first constrained step

    def use_decode_graphs(self, num_kv_heads: int, max_batch_size: int, max_model_len: int) -> None:
        """Runs decode steps of up to `max_batch_size` sequences through CUDA graphs (see
        `cuda_graph`), captured now on CUDA; off CUDA the same padded path runs eagerly."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, num_kv_heads, max_batch_size, max_model_len,
                                          self.block_size)

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, PreparedBatch, Pooled]:
        """One forward pass over the plan: the logits at the batch's `logits_rows`, the batch, and
        the embeddings of the pooling sequences whose prompt ends in it (see `Pooler.pool`)."""
        batch = prepare_batch(plan, self.block_size, self.device)
        if not batch.pooled and self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return self.decode_graphs.run(batch.input_ids, batch.positions, batch.meta), batch, ()
        if self.native is not None:
            hidden = self.native(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, self.backend)
        pooled = self.pooler.pool(hidden, batch.pooled) if batch.pooled else ()
        return self.model.compute_logits(hidden[batch.logits_rows]), batch, pooled

    def draft_greedy(self, plan: StepPlan, budgets: dict[Sequence, int],
                     min_confidence: float) -> dict[Sequence, list[int]] | None:
        """Greedy drafts for every sequence of `plan` (each ends its step at its last token) in one
        native call (`NativeDecoder.draft_greedy`: the step, then a pass per further draft, up to
        `budgets[seq]` drafts, stopping after one given less than `min_confidence`); None when the
        native decoder does not take the step, and the caller drafts pass by pass."""
        if self.native is None:
            return None
        batch = prepare_batch(plan, self.block_size, self.device)
        drafts = self.native.draft_greedy(batch.input_ids, batch.positions, self.kv_cache, batch.meta,
                                          [budgets[s] for s in batch.sampled], min_confidence, self.vocab_size)
        return dict(zip(batch.sampled, drafts, strict=True))

    def execute(self, plan: StepPlan) -> StepResult:
        masks = self._start_masks(plan)
        logits, batch, pooled = self.forward(plan)
        load = self.take_expert_load()
        num_sampled = len(batch.sampled)
        sampled = SamplerOutput([], None, None)
        if num_sampled:
            allowed = None if masks is None else masks.result()
            sampled = self.sampler(logits[:num_sampled], self._sampling_batch(batch.sampled, allowed))
        num_prompt = sum(count for _, _, count in batch.prompt_rows)
        verified = self._verify(logits[num_sampled : logits.shape[0] - num_prompt], batch.verified)
        if not num_prompt:
            return StepResult(batch.sampled, sampled, verified, pooled=pooled, expert_load=load)
        prompt = self._prompt_logprobs(logits[logits.shape[0] - num_prompt :], batch.prompt_rows)
        return StepResult(batch.sampled, sampled, verified, prompt, pooled, load)

    def take_expert_load(self) -> torch.Tensor | None:
        """The model's expert counts since the previous call (`CausalLM.take_expert_load`), then
        zeroed; None for a dense model or a stand-in."""
        return self.model.take_expert_load() if isinstance(self.model, CausalLM) else None

    def expert_bytes(self) -> list[int]:
        """The weight bytes of one expert of each MoE layer, in layer order (empty for a dense model)."""
        return [m.expert_bytes for m in self.model.moe_layers] if isinstance(self.model, CausalLM) else []

    @torch.inference_mode()
    def _prompt_logprobs(self, logits: torch.Tensor, spans: tuple[tuple[Sequence, int, int], ...]
                         ) -> tuple[tuple[Sequence, int, list[PromptLogprob]], ...]:
        """Raw logprob, rank and top-k of each prompt token after the positions `spans` list (their
        rows of `logits`, span after span), all rows in one pass."""
        raw = torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)
        targets = torch.tensor([t for seq, first, count in spans
                                for t in seq.prompt_token_ids[first + 1 : first + 1 + count]],
                               dtype=torch.long, device=raw.device).unsqueeze(1)
        chosen = raw.gather(1, targets)
        ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
        k_max = max(seq.params.prompt_logprobs or 0 for seq, _, _ in spans)
        values, ids = raw.topk(k_max, dim=-1) if k_max else (raw[:, :0], raw[:, :0].long())
        chosen_list, top_ids, top_values = chosen.squeeze(1).tolist(), ids.tolist(), values.tolist()
        out: list[tuple[Sequence, int, list[PromptLogprob]]] = []
        row = 0
        for seq, first, count in spans:
            k = seq.params.prompt_logprobs or 0
            entries = [PromptLogprob(seq.prompt_token_ids[first + 1 + j], chosen_list[row + j], ranks[row + j],
                                     list(zip(top_ids[row + j][:k], top_values[row + j][:k], strict=True)))
                       for j in range(count)]
            out.append((seq, first, entries))
            row += count
        return tuple(out)

    def _verify(self, logits: torch.Tensor, verified: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """The kept tokens of each sequence with drafts; `logits` holds its last token's row and one
        row per draft, sequence after sequence. Greedy sequences share one argmax over all rows;
        sampled ones one `sampling_probs` and one batched `verify`."""
        kept: dict[Sequence, list[int]] = {}
        greedy: list[tuple[Sequence, list[int], int]] = []  # (sequence, its drafts, its first row)
        sampled_rows: list[int] = []
        sampled: list[tuple[Sequence, Proposal]] = []
        row = 0
        for seq in verified:
            draft = _proposal(seq)
            k = len(draft.tokens)
            if seq.params.greedy:
                greedy.append((seq, draft.tokens, row))
            else:
                sampled_rows.extend(range(row, row + k + 1))
                sampled.append((seq, draft))
            row += k + 1
        if greedy:
            argmax = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for seq, tokens, row in greedy:
                kept[seq] = verify_greedy(argmax[row : row + len(tokens) + 1], tokens)
        if sampled:
            params = [r.params for r, d in sampled for _ in range(len(d.tokens) + 1)]
            targets = sampling_probs(logits[sampled_rows], params, self.vocab_size)
            outs = verify(targets, [d.tokens for _, d in sampled], [d.probs for _, d in sampled],
                          [self._generator(r) for r, _ in sampled])
            kept.update(zip([r for r, _ in sampled], outs, strict=True))
        return [(seq, kept[seq]) for seq in verified]

    def _start_masks(self, plan: StepPlan) -> Future[tuple[torch.Tensor, torch.Tensor]] | None:
        """Starts filling the grammar masks of the step's constrained sampled rows (rows counted as
        `prepare_batch` orders `sampled`: no draft, the step reaches the last token) on the worker
        thread; None, and no work at all, when no such row is constrained."""
        rows: list[int] = []
        matchers = []
        row = 0
        for seq, n in plan.scheduled:
            if seq.draft is None and seq.params.pooling is None and seq.num_computed_tokens + n == seq.num_tokens:
                if seq.grammar is not None:
                    rows.append(row)
                    matchers.append(seq.grammar)
                row += 1
        if not matchers:
            return None
        grammars = self.grammars
        assert grammars is not None, "a constrained sequence in an engine without a grammar compiler"
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar-masks")

        def masks() -> tuple[torch.Tensor, torch.Tensor]:
            allowed = unpack_bitmask(grammars.fill_masks(matchers), self.vocab_size, self.device)
            return torch.tensor(rows, dtype=torch.long, device=self.device), allowed

        return self._mask_worker.submit(masks)

    def close(self) -> None:
        """Releases what the runner holds outside this process (a tensor-parallel runner's worker
        ranks); this one holds nothing there."""

    def release(self, seq: Sequence) -> None:
        """Forgets a finished request's generator and running pooled sum."""
        self._generators.pop(seq.key, None)
        self.pooler.release(seq)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's own generator when it is seeded and samples (created on first use)."""
        p = seq.params
        if p.seed is None or p.greedy:
            return None
        gen = self._generators.get(seq.key)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed((p.seed + seq.index) % 2**64)
            self._generators[seq.key] = gen
        return gen

    def _sampling_batch(self, seqs: list[Sequence],
                        allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplingBatch:
        generators: list[torch.Generator | None] = []
        suppressed: list[frozenset[int]] = []
        for seq in seqs:
            p = seq.params
            generators.append(self._generator(seq))
            if seq.num_output_tokens < p.min_tokens:
                eos = frozenset() if p.ignore_eos else self.stop_token_ids
                suppressed.append(eos | frozenset(p.stop_token_ids))
            else:
                suppressed.append(frozenset())
        return SamplingBatch.build(
            [r.params for r in seqs], [r.output_token_ids for r in seqs], [r.prompt_token_ids for r in seqs],
            generators, self.vocab_size, self.device, suppressed, allowed,
        )
