"""Draft-model proposer for speculative decoding: a smaller model sharing the target's tokenizer.

The draft keeps its own paged KV (its own pool and a block table per sequence) and a shadow
`Sequence` per target sequence. Each proposal first feeds the shadow whatever target tokens it has
not computed (the whole prompt the first time; afterwards the target's last accepted tokens), then
runs one single-token step per further draft, all sequences batched in each pass; where every
sequence drafts greedily and the draft runs on nanoserve's CPU kernels, those passes are one native
call (`ModelRunner.draft_greedy`), which proposes the same drafts (but for a draft whose
probability sits at the confidence threshold to float rounding). Drafts are drawn
from the draft's own sampling distribution q (same parameters as the request), and q is returned
so the target can verify by rejection sampling; greedy requests draft the draft's argmax (q is a
point mass, returned as None).

Invariant: a shadow's K/V is valid for its first `num_computed_tokens` tokens, which always agree
with the target sequence: after verification it is cut back to the tokens the target kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention import AttentionBackend
from nanoserve.engine.model_protocol import KVShape, Model
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.sampler import inverse_cdf, sampling_probs
from nanoserve.engine.scheduler import StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode import Proposal
from nanoserve.kv.manager import KVCacheManager


@dataclass(slots=True)
class _Shadow:
    mirror: Sequence  # the draft-side sequence: its table, all_token_ids and num_computed_tokens
    base: int  # the target's length when the last drafts were proposed
    generator: torch.Generator | None


class DraftModelProposer:
    def __init__(self, model: Model, kv_shape: KVShape, num_blocks: int, block_size: int, vocab_size: int,
                 device: torch.device, min_confidence: float = 0.2, backend: AttentionBackend | None = None) -> None:
        """`min_confidence`: a sequence stops drafting before its budget after a draft to which the
        draft model's softmax (temperature 1, no filters) gave less than this probability; that draft
        is still proposed. A draft it is unsure of is likely rejected, and each further draft costs a
        whole draft pass. Exactness does not depend on it (whether a draft follows depends only on
        earlier drafts). 0 drafts the whole budget. transformers' assisted generation stops at 0.4;
        drafts made in one native call are cheap enough that 0.2 yields more (docs/speculative.md).
        `backend`: the draft runner's attention backend (default: torch)."""
        self.min_confidence = min_confidence
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, kv_shape, num_blocks, block_size, vocab_size, frozenset(), device, backend)
        self.vocab_size = vocab_size
        self.device = device
        self._shadows: dict[tuple[str, int], _Shadow] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        active: list[tuple[Sequence, _Shadow, int]] = []
        for seq, k in zip(seqs, budgets, strict=True):
            shadow = self._shadow(seq)
            shadow.mirror.all_token_ids = list(seq.all_token_ids)
            shadow.base = seq.num_tokens
            # K/V up to the last draft but one: the last draft is only proposed, never fed.
            if self.kv.allocate(shadow.mirror.table, seq.num_tokens + k - 1):
                active.append((seq, shadow, k))
            else:
                self.release(seq)
        drafts: dict[Sequence, list[int]] = {seq: [] for seq, _, _ in active}
        dists: dict[Sequence, list[torch.Tensor]] = {seq: [] for seq, _, _ in active}
        any_greedy = any(seq.params.greedy for seq, _, _ in active)
        step = 0
        while active:
            plan = StepPlan([(s.mirror, s.mirror.num_tokens - s.mirror.num_computed_tokens) for _, s, _ in active])
            if all(seq.params.greedy for seq, _, _ in active):  # the passes left in one native call, where it runs
                native = self.runner.draft_greedy(plan, {s.mirror: k - step for _, s, k in active}, self.min_confidence)
                if native is not None:
                    for seq, shadow, _ in active:
                        drafts[seq] += native[shadow.mirror]
                        shadow.mirror.all_token_ids += native[shadow.mirror]
                        shadow.mirror.num_computed_tokens = shadow.mirror.num_tokens - 1  # all but the last draft
                    break
            logits, batch, _ = self.runner.forward(plan)
            # Logits rows follow `batch.sampled` (the plan's order). Greedy rows draft the argmax (q is
            # a point mass: nothing to keep); sampled rows draw from q, all in one `sampling_probs`,
            # each with one uniform from its own stream.
            by_seq = {shadow.mirror: (seq, shadow) for seq, shadow, _ in active}
            pairs = [by_seq[s] for s in batch.sampled]
            tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist() if any_greedy else [0] * len(pairs)
            sampled = [row for row, (seq, _) in enumerate(pairs) if not seq.params.greedy]
            if sampled:
                q = sampling_probs(logits[sampled], [pairs[row][0].params for row in sampled], self.vocab_size)
                u = torch.cat([torch.rand(1, generator=pairs[row][1].generator, device=q.device) for row in sampled])
                for j, (row, token) in enumerate(zip(sampled, inverse_cdf(q, u).tolist(), strict=True)):
                    tokens[row] = token
                    dists[pairs[row][0]].append(q[j])
            confident = [True] * len(pairs)
            if self.min_confidence > 0:
                chosen = torch.tensor(tokens, device=logits.device)[:, None]
                conf = torch.softmax(logits[:, : self.vocab_size].float(), dim=-1).gather(1, chosen)
                confident = (conf[:, 0] >= self.min_confidence).tolist()
            stopped = set()
            for (seq, shadow), token, ok in zip(pairs, tokens, confident, strict=True):
                shadow.mirror.num_computed_tokens = shadow.mirror.num_tokens
                drafts[seq].append(token)
                shadow.mirror.all_token_ids.append(token)
                if not ok:
                    stopped.add(seq)
            step += 1
            active = [a for a in active if a[2] > step and a[0] not in stopped]
        return [Proposal(drafts[r], None if r.params.greedy else torch.stack(dists[r])) if r in drafts
                else Proposal([], None) for r in seqs]

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        shadow = self._shadows.get(seq.key)
        if shadow is not None:  # its K/V after the accepted drafts belongs to rejected tokens
            mirror = shadow.mirror
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, shadow.base + num_accepted)

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.key, None)
        if shadow is not None:
            self.kv.free(shadow.mirror.table, shadow.mirror.all_token_ids, 0)

    def _shadow(self, seq: Sequence) -> _Shadow:
        shadow = self._shadows.get(seq.key)
        if shadow is None:
            p = seq.params
            gen = None
            if p.seed is not None and not p.greedy:  # its own stream, apart from the target's
                gen = torch.Generator(self.device).manual_seed((p.seed + seq.index + 1) % 2**64)
            mirror = Sequence(seq.request_id, [], p, 0, index=seq.index)
            shadow = self._shadows[seq.key] = _Shadow(mirror, 0, gen)
        return shadow
