"""Speculative decoding: proposers and the exact accept/reject rule.

A proposer suggests up to k draft tokens for a decoding sequence; the target model scores the
sequence's last token and the drafts in one pass (inside the normal batched step), and
`verify` keeps the longest acceptable prefix plus one token of its own, by the rejection-sampling
rule of Leviathan et al. (2023) and Chen et al. (2023): draft d, drawn from q, is accepted with
probability min(1, p(d) / q(d)); on rejection a token is drawn from norm(max(p - q, 0)); after k
acceptances a bonus token is drawn from p. The output is distributed exactly as the target's p.
Greedy requests are the special case p = one-hot(argmax): output equals plain greedy decoding.

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

from nanoserve.engine.request import Request
from nanoserve.engine.sampler import inverse_cdf


class Proposal(NamedTuple):
    """Draft tokens for one sequence and, for sampled drafts, the draft distributions [k, V] they
    came from (None means a point mass on each draft)."""

    tokens: list[int]
    probs: torch.Tensor | None


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
    def propose(self, requests: list[Request], budgets: list[int]) -> list[Proposal]:
        """At most budgets[i] drafts for requests[i] (all in decode: every token but the last is
        computed)."""
        ...

    def release(self, req: Request) -> None:
        """Forgets a sequence that finished or was preempted."""
        ...

    def accepted(self, req: Request, num_accepted: int) -> None:
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

    def propose(self, requests: list[Request], budgets: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(r.all_token_ids, k), None) for r, k in zip(requests, budgets, strict=True)]

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
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= len(arr)]
                start = int(full[-1] if full.size else hits[0]) + n
                return arr[start : start + k].tolist()
        return []

    def release(self, req: Request) -> None:
        pass

    def accepted(self, req: Request, num_accepted: int) -> None:
        pass


def verify(target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a sequence keeps: the accepted prefix of `drafts` plus one token drawn by the
    rejection rule. `target` [k+1, V] holds the target's sampling distributions (`sampling_probs`)
    at the last token and after each draft. Draws exactly 2 * (k + 1) uniforms from `generator`
    (torch's default one if None), so a seeded request's stream does not depend on the batch."""
    k = len(drafts)
    u = torch.rand(2 * (k + 1), generator=generator, device=generator.device if generator else None).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = target[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if u[2 * i] * q_d < float(p[d]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself is the residual
            residual = p
        out.append(int(inverse_cdf(residual[None], torch.tensor([u[2 * i + 1]], device=p.device))[0]))
        return out
    out.append(int(inverse_cdf(target[k][None], torch.tensor([u[2 * k + 1]], device=target.device))[0]))
    return out
