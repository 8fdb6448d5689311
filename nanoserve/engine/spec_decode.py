"""Speculative decoding: proposers and the exact accept/reject rule.

A proposer suggests up to k draft tokens for a decoding sequence; the target model scores the
sequence's last token and the drafts in one pass (inside the normal batched step), and
`verify` keeps the longest acceptable prefix plus one token of its own, by the rejection-sampling
rule of Leviathan et al. (2023) and Chen et al. (2023): draft d, drawn from q, is accepted with
probability min(1, p(d) / q(d)); on rejection a token is drawn from norm(max(p - q, 0)); after k
acceptances a bonus token is drawn from p. The output is distributed exactly as the target's p.
Greedy requests are the special case p = one-hot(argmax): output equals plain greedy decoding;
`verify_greedy` is that case computed from the argmax ids alone (no distributions, no draws).

Proposers:
- `NgramProposer` (prompt lookup): the continuation of the latest earlier occurrence of the
  sequence's last n tokens; its q is a point mass on each draft.
- `nanoserve.engine.draft_model.DraftModelProposer`: a smaller model sharing the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from nanoserve.engine.sampler import inverse_cdf
from nanoserve.engine.sequence import Sequence


class Proposal(NamedTuple):
    """Draft tokens for one sequence and, for sampled drafts, the draft distributions [k, V] they
    came from (None means a point mass on each draft). The `request.Draft` a sequence carries."""

    tokens: list[int]
    probs: torch.Tensor | None

    def truncate(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n])


@dataclass(slots=True)
class SpecStats:
    """Counters over every verification of a sequence's drafts."""

    proposed: int = 0
    accepted: int = 0
    verifications: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the accepted drafts plus the target's own."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        """At most budgets[i] drafts for seqs[i] (all in decode: every token but the last is
        computed)."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forgets a sequence that finished or was preempted."""
        ...

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Reports how many of the sequence's last drafts the target accepted."""
        ...


class NgramProposer:
    """Prompt-lookup decoding: match the last n tokens (n from `max_n` down to `min_n`) against the
    sequence's earlier tokens; propose what followed the latest match that is followed by k tokens
    (or, if none is, the earliest match, which has the longest continuation). A continuation cut
    short by the end of the sequence is extended by looking up again after it (so a loop of period
    p still yields k drafts). Stateless."""

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(r.all_token_ids, k), None) for r, k in zip(seqs, budgets, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        out: list[int] = []
        seq = list(tokens)
        while len(out) < k:
            more = self._continuation(seq, k - len(out))
            if not more:
                break
            out += more
            seq += more
        return out

    def _continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the chosen match of the longest suffix (n <= max_n) seen earlier.

        A match of length n ends at position e < len - 1 with tokens[e - j] == tokens[-1 - j] for
        j < n. Candidates are the ends matching the last token, narrowed one suffix token at a time
        while any survive, so only the few candidate positions are compared, never whole windows."""
        arr = np.asarray(tokens, dtype=np.int64)
        last = len(arr) - 1
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        n = 1
        for j in range(1, min(self.max_n, last)):
            ends_j = ends[ends >= j]
            longer = ends_j[arr[ends_j - j] == arr[last - j]]
            if longer.size == 0:
                break
            ends, n = longer, j + 1
        if ends.size == 0 or n < self.min_n:
            return []
        full = ends[ends + k < len(arr)]
        start = int(full[-1] if full.size else ends[0]) + 1
        return arr[start : start + k].tolist()

    def release(self, seq: Sequence) -> None:
        pass

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        pass


def verify(targets: torch.Tensor, drafts: list[list[int]], draft_probs: list[torch.Tensor | None],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """The tokens each sequence keeps: the accepted prefix of its drafts plus one token drawn by the
    rejection rule, for a batch of sequences at once.

    `targets` [sum(k_s + 1), V] holds the target's sampling distributions (`sampling_probs`),
    sequence after sequence, at the last token and after each of its k_s drafts; `draft_probs[s]`
    [k_s, V] the distributions its drafts were drawn from (None: point masses). Sequence s draws
    exactly 2 * (k_s + 1) uniforms from `generators[s]` (torch's default one if None): u[2i] decides
    draft i, u[2i + 1] draws the replacement at the first rejection i (or the bonus, i = k_s), so a
    seeded request's stream, and what it keeps, do not depend on the batch."""
    device = targets.device
    lengths = [len(d) for d in drafts]
    starts = np.cumsum([0, *[k + 1 for k in lengths]])[:-1].tolist()
    gens = zip(lengths, generators, strict=True)
    u = torch.cat([torch.rand(2 * (k + 1), generator=g, device=device) for k, g in gens])
    # Draft j of the flat list (sequence s, draft i) is j = starts[s] - s + i, at targets row j + s.
    draft_rows = [starts[s] + i for s, k in enumerate(lengths) for i in range(k)]
    flat = [d for ds in drafts for d in ds]
    accepted: list[bool] = []
    if flat:
        p_d = targets[draft_rows, flat].double()
        q_d = torch.ones_like(p_d)
        sampled = [(s, q) for s, q in enumerate(draft_probs) if q is not None and lengths[s]]
        if sampled:  # each draft's q(d), gathered from the draft distributions that exist
            at = [j for s, _ in sampled for j in range(starts[s] - s, starts[s] - s + lengths[s])]
            q_rows = torch.cat([q[: lengths[s]] for s, q in sampled])
            q_d[at] = q_rows[list(range(len(at))), [flat[j] for j in at]].double()
        accepted = (u[[2 * r for r in draft_rows]].double() * q_d < p_d).tolist()
    kept: list[list[int]] = []
    final_rows, rejected, u_rows = [], [], []
    for s, (ds, start) in enumerate(zip(drafts, starts, strict=True)):
        i = next((i for i in range(len(ds)) if not accepted[start - s + i]), len(ds))
        kept.append(ds[:i])
        final_rows.append(start + i)
        u_rows.append(2 * (start + i) + 1)
        if i < len(ds):
            rejected.append((s, i))
    weights = targets[final_rows]  # a copy: bonus rows, and the rows that become residuals
    if rejected:  # the residual max(p - q, 0); for a point mass at d that is p without d
        rows = [s for s, _ in rejected]
        residual = weights[rows]
        point = [j for j, (s, _) in enumerate(rejected) if draft_probs[s] is None]
        if point:
            residual[point, [drafts[rejected[j][0]][rejected[j][1]] for j in point]] = 0.0
        dist = [(j, probs[i]) for j, (s, i) in enumerate(rejected) if (probs := draft_probs[s]) is not None]
        if dist:
            at = [j for j, _ in dist]
            residual[at] = (residual[at] - torch.stack([q for _, q in dist])).clamp_(min=0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0.0  # p == q up to rounding: p itself is the residual
        weights[rows] = torch.where(empty, weights[rows], residual)
    tokens = inverse_cdf(weights, u[u_rows]).tolist()
    return [[*ks, t] for ks, t in zip(kept, tokens, strict=True)]


def verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """`verify` for a greedy request, from the target's argmax at the last token and after each draft
    (len(drafts) + 1 ids): a draft is accepted iff it equals the argmax at its position, and the
    token after the accepted prefix is the argmax there, so the kept tokens are a prefix of `argmax`.
    Equals `verify` on the one-hot targets `sampling_probs` gives greedy requests, and draws nothing."""
    for i, d in enumerate(drafts):
        if d != argmax[i]:
            return argmax[: i + 1]
    return argmax[: len(drafts) + 1]
