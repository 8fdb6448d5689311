"""Batched, per-request sampling: logits of one step -> one token per row (+ logprobs).

One step runs, all vectorised over the batch:

1. raw logprobs = log_softmax(logits) (only if some row asked for logprobs);
2. penalties (repetition, then frequency and presence) on the rows that use them;
3. token constraints (`_TokenConstraints`: logit bias, allowed token ids, bad words) on the rows
   that have them;
3b. suppressed ids (stop/EOS ids while `min_tokens` is not reached) -> -inf;
   grammar masks: on constrained rows, every token the row's grammar forbids -> -inf;
4. greedy rows take the argmax (ties: lowest id);
5. sampled rows divide by their temperature, then keep top-k, then top-p, then min-p (each on the
   distribution the previous one left), and draw one token by inverse CDF, in token-id order, from a
   single uniform per row.

Reproducibility: a row with a generator draws exactly one number from it per step, and what a row
gets depends only on its own logits, parameters and draw, never on the other rows of the batch:
filters a row does not use are neutral for it, each filter keeps a set defined by a threshold (so
no tie order enters), and the draw walks the CDF in token-id order. Top-k and top-p find their
thresholds among the few largest values (topk), widening only for rows that need more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from nanoserve.engine.sampling_params import SamplingParams

# Temperatures below this are raised to it, so that logits / temperature stays finite.
_MIN_TEMPERATURE = 1e-5
# How many of the largest probabilities top-p looks at first (see `_top_p_floor`).
_TOP_P_FIRST_WIDTH = 256


def _flat_ids(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of a ragged list of id lists, as two flat int64 tensors."""
    lengths = torch.tensor([len(r) for r in ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    cols = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.long)
    return rows.to(device), cols.to(device)


@dataclass(slots=True, frozen=True)
class _Penalties:
    """Penalties as one entry per distinct (row, token) a penalised row has seen in its prompt or
    output; every other logit is left alone, so the cost is O(entries), not O(rows x vocabulary).

    Entry e multiplies or divides logit (rows[e], ids[e]) by `repetition[e]`, then subtracts
    `offset[e]` = frequency * output count + presence * (output count > 0).
    """

    rows: torch.Tensor  # [E] int64, batch rows
    ids: torch.Tensor  # [E] int64
    repetition: torch.Tensor  # [E]
    offset: torch.Tensor  # [E]

    @classmethod
    def build(
        cls,
        penalised: set[int],
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> _Penalties:
        def keys(ids: Sequence[Sequence[int]]) -> torch.Tensor:
            rows, cols = _flat_ids([r if i in penalised else [] for i, r in enumerate(ids)], device)
            return rows * vocab_size + cols

        out_keys, prompt_keys = keys(output_ids), keys(prompt_ids)
        unique, inverse = torch.unique(torch.cat([out_keys, prompt_keys]), return_inverse=True)
        counts = torch.zeros(unique.numel(), device=device)
        counts.index_add_(0, inverse[: out_keys.numel()], torch.ones(out_keys.numel(), device=device))
        rows = unique // vocab_size

        def per_entry(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)[rows]

        frequency = per_entry([p.frequency_penalty for p in params])
        presence = per_entry([p.presence_penalty for p in params])
        return cls(
            rows=rows,
            ids=unique % vocab_size,
            repetition=per_entry([p.repetition_penalty for p in params]),
            offset=frequency * counts + presence * (counts > 0),
        )

    def apply_(self, logits: torch.Tensor) -> None:
        """Penalises `logits` [B, V] in place (HF/vLLM repetition rule, OpenAI frequency/presence)."""
        seen = logits[self.rows, self.ids]
        seen = torch.where(seen > 0, seen / self.repetition, seen * self.repetition) - self.offset
        logits[self.rows, self.ids] = seen


@dataclass(slots=True, frozen=True)
class _TokenConstraints:
    """logit_bias, allowed_token_ids and bad words of the rows that have them, as sparse tensors:
    rows without any are never touched.

    `bias` adds values[e] to logit (rows[e], ids[e]); `allowed` keeps, in each of its rows, only the
    ids marked in its mask [R, V] (the others -> -inf); `banned` sets (rows[e], ids[e]) to -inf: the
    single-token bad words, and the last token of each longer bad word whose other tokens end the
    row's output so far.
    """

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, values)
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # (rows [R], keep mask [R, V])
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_ids: Sequence[Sequence[int]], vocab_size: int,
              device: torch.device) -> _TokenConstraints | None:
        """None when no row has a constraint. Ids >= vocab_size are ignored (requests are validated
        against the vocabulary before they reach the engine)."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        allowed: list[tuple[int, list[int]]] = []
        banned: list[list[int]] = [[] for _ in params]
        for i, p in enumerate(params):
            if not p.uses_token_constraints:
                continue
            for t, b in (p.logit_bias or {}).items():
                if t < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(t)
                    bias_values.append(b)
            if p.allowed_token_ids is not None:
                allowed.append((i, [t for t in p.allowed_token_ids if t < vocab_size]))
            out = output_ids[i]
            for word in p.bad_words_token_ids or ():
                prefix = len(word) - 1
                if word[-1] < vocab_size and (prefix == 0 or (len(out) >= prefix and list(out[-prefix:]) == word[:-1])):
                    banned[i].append(word[-1])
        if not bias_rows and not allowed and not any(banned):
            return None
        bias = None
        if bias_rows:
            bias = (torch.tensor(bias_rows, dtype=torch.long, device=device),
                    torch.tensor(bias_ids, dtype=torch.long, device=device),
                    torch.tensor(bias_values, dtype=torch.float32, device=device))
        keep = None
        if allowed:
            mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
            mask_rows, mask_ids = _flat_ids([ids for _, ids in allowed], device)
            mask[mask_rows, mask_ids] = True
            keep = (torch.tensor([i for i, _ in allowed], dtype=torch.long, device=device), mask)
        return cls(bias, keep, _flat_ids(banned, device) if any(banned) else None)

    def apply_(self, logits: torch.Tensor) -> None:
        """Biases, restricts and bans in place on `logits` [B, V]."""
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.allowed is not None:
            rows, keep = self.allowed
            logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
        if self.banned is not None:
            logits[self.banned] = float("-inf")


@dataclass(slots=True, frozen=True)
class _SampledRows:
    """The rows that sample (temperature > 0), in batch order.

    Filter tensors are `[n, 1]` and None when no row uses that filter; rows that do not use a present
    filter hold its neutral value (top_k = 0, top_p = 1, min_p = 0), which keeps every token, so a
    row's result never depends on which filters other rows use. `top_k_max` is the largest top_k.
    """

    rows: torch.Tensor  # [n] int64, batch rows
    temperature: torch.Tensor  # [n, 1]
    seeded: tuple[tuple[int, torch.Generator], ...]  # (index among these rows, its generator)
    top_k: torch.Tensor | None
    top_k_max: int
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def build(
        cls,
        rows: list[int],
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> _SampledRows:
        def column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        group = [params[i] for i in rows]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in group]
        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            temperature=column([max(p.temperature, _MIN_TEMPERATURE) for p in group]),
            seeded=tuple((j, g) for j, i in enumerate(rows) if (g := generators[i]) is not None),
            top_k=column(top_k, torch.long) if any(top_k) else None,
            top_k_max=max(top_k),
            top_p=column([p.top_p for p in group]) if any(p.top_p < 1 for p in group) else None,
            min_p=column([p.min_p for p in group]) if any(p.min_p > 0 for p in group) else None,
        )

    def uniforms(self) -> torch.Tensor:
        """One U[0, 1) per row: seeded rows from their own generator (one draw each), others from
        torch's default generator."""
        device = self.rows.device
        u = torch.rand(self.rows.numel(), device=device)
        for j, gen in self.seeded:
            u[j] = torch.rand((), generator=gen, device=device)
        return u

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Token ids [n] for these rows of the penalised `logits` [B, V]."""
        return inverse_cdf(self.probs(logits), self.uniforms())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The (unnormalised) distribution [n, V] these rows draw from.

        Each filter zeroes the probability of the tokens it drops; the kept sets are defined by
        thresholds, so tokens tied with the last kept one are kept too and no tie order matters.
        """
        scaled = logits[self.rows].div_(self.temperature)
        probs = torch.softmax(scaled, dim=-1)
        if self.top_k is not None:
            kth = scaled.topk(self.top_k_max, dim=-1).values.gather(1, (self.top_k - 1).clamp(min=0))
            probs = probs.masked_fill((scaled < kth) & (self.top_k > 0), 0.0)
        if self.top_p is not None:
            probs = probs.masked_fill(probs < _top_p_floor(probs, self.top_p), 0.0)
        if self.min_p is not None:
            probs = probs.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int) -> torch.Tensor:
    """The distribution [n, vocab_size] the sampler draws from for each row of `logits`, under that
    row's `params[i]` (which use no penalties): one-hot at the argmax when greedy, else temperature,
    top-k, top-p and min-p applied and the result normalised. All rows in one vectorised pass; a
    row's result depends only on its own logits and parameters. Speculative decoding verifies
    against it, and a draft model draws its drafts from it."""
    logits = logits[:, :vocab_size].float()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if len(sampled) < len(params):
        probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab_size).float()
    else:
        probs = torch.empty_like(logits)
    if sampled:
        rows = _SampledRows.build(sampled, params, [None] * len(params), vocab_size, logits.device)
        kept = rows.probs(logits)  # reads rows.rows of logits into a new tensor; logits is untouched
        probs[rows.rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row `[n, 1]`, the smallest probability top-p keeps: that of the last token of the shortest
    descending prefix whose mass reaches `top_p` times the row's total (`probs` [n, V] need not be
    normalised); 0, keeping all, where top_p >= 1 or rounding never reaches the target.

    The largest `_TOP_P_FIRST_WIDTH` probabilities are sorted first (by topk), which settles a
    peaked row; the rows whose mass they do not reach go to `_radix_floor`, exact without a sort
    (a full sort of a 150K vocabulary is slow on a CPU, row by row). Which path a row takes
    depends on that row alone.
    """
    vocab = probs.shape[1]
    target = top_p * probs.sum(dim=-1, keepdim=True)
    floor = torch.zeros_like(target)
    pending = (top_p < 1).squeeze(1).nonzero().squeeze(1)
    if pending.numel() == 0:
        return floor
    values = probs[pending].topk(min(_TOP_P_FIRST_WIDTH, vocab), dim=-1).values
    reached = values.cumsum(dim=-1) >= target[pending]
    found = reached.any(dim=-1)
    cut = reached.to(torch.int8).argmax(dim=-1, keepdim=True)
    floor[pending[found]] = values.gather(1, cut)[found]
    rest = pending[~found]
    if rest.numel() == probs.shape[0]:  # every row (no gather copy of the whole batch)
        floor = _radix_floor(probs, target).to(floor.dtype)
    elif rest.numel() > 0:
        floor[rest] = _radix_floor(probs[rest], target[rest]).to(floor.dtype)
    return floor


def _radix_floor(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row `[n, 1]`, the largest value v of `probs` (non-negative, [n, V]) whose mass
    sum(p for p >= v) reaches `target`, or 0 where even the whole row does not (rounding).

    Radix selection: non-negative float32 values order as their bit patterns do, so two passes of
    `_bucket_crossing` fix v's high 16 bits, then its low 16 bits among the values whose high half
    is v's. No sort; ties share a bit pattern, so all of them are kept.
    """
    probs = probs.float().contiguous()
    bits = probs.view(torch.int32)
    high = bits >> 16  # the sign bit is 0: 0 .. 32767
    target = target.double()
    top, above = _bucket_crossing(high, probs, target, torch.zeros_like(target))
    low, _ = _bucket_crossing(bits & 0xFFFF, torch.where(high == top, probs, 0.0), target, above)
    reached = probs.sum(dim=-1, keepdim=True, dtype=torch.float64) >= target
    return ((top << 16) | low).view(torch.float32).masked_fill(~reached, 0.0)


def _bucket_crossing(digits: torch.Tensor, weights: torch.Tensor, target: torch.Tensor,
                     above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the 16-bit digit whose bucket the mass first reaches `target` in, summing the
    buckets of `weights` by `digits` from the top down after `above` (mass already above them);
    and the mass above that bucket, `above` included. Both `[n, 1]`. A bucket holds values of one
    magnitude, so its float32 sum is as exact as the values; the running sum is in float64."""
    buckets = torch.zeros(digits.shape[0], 1 << 16, dtype=weights.dtype, device=digits.device)
    buckets.scatter_add_(1, digits.long(), weights)
    from_top = buckets.flip(1).double().cumsum(dim=1)  # column j: buckets 65535 - j .. 65535
    j = torch.searchsorted(from_top, target - above).clamp_(max=(1 << 16) - 1)
    bucket = buckets.gather(1, 65535 - j).double()
    return (65535 - j).to(torch.int32), above + from_top.gather(1, j) - bucket


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column j per row with cdf[j-1] < (1 - u) * total <= cdf[j], for non-negative `weights` [n, V]
    (need not be normalised) and `u` [n] in [0, 1). The target lies in (0, total], so the chosen
    column always has positive weight, whatever the rounding."""
    cdf = weights.cumsum(dim=-1)
    target = (1.0 - u).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling state for one step, as tensors on the logits' device. Built once per step by
    the runner with `build`; rows are in the order of the logits rows.

    Invariants: `sampled` holds exactly the rows with temperature > 0 (None if there are none);
    every other row is greedy. `penalties` is None iff no row uses penalties,
    `suppressed` is None iff nothing is suppressed, `constraints` is None iff no row has a token
    constraint, `logprobs_k` is None iff no row asked for
    logprobs (else it holds each row's top-logprobs count, 0 for rows that asked none). An all-greedy
    batch with none of those holds no tensor at all.
    """

    vocab_size: int
    sampled: _SampledRows | None
    penalties: _Penalties | None
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (rows, ids) to set to -inf
    logprobs_k: tuple[int, ...] | None
    # Constrained rows [m] and their allowed tokens [m, vocab_size] bool (`structured`); None iff
    # no row is constrained. Each row allows at least one token.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    constraints: _TokenConstraints | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        stop_ids_suppressed: Sequence[frozenset[int]],
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingBatch:
        """All sequences are indexed by row and have the same length; every id in `output_ids` and
        `prompt_ids` is < `vocab_size`.

        `vocab_size`: the number of real token ids; logits columns from it on (a padded LM head) are
        never sampled and not part of the logprobs. `generators[i]` is row i's own generator (on
        `device`, owned and seeded by the caller) or None for torch's default one.
        `stop_ids_suppressed[i]`: ids row i may not emit this step; ids >= vocab_size are ignored.
        `allowed`: the grammar masks of the constrained rows (see the field).
        """
        sizes = {len(params), len(output_ids), len(prompt_ids), len(generators), len(stop_ids_suppressed)}
        if len(sizes) != 1:
            raise ValueError(f"per-row sequences differ in length: {sorted(sizes)}")

        rows = [i for i, p in enumerate(params) if not p.greedy]
        sampled = _SampledRows.build(rows, params, generators, vocab_size, device) if rows else None

        penalised = {i for i, p in enumerate(params) if p.uses_penalties}
        penalties = (
            _Penalties.build(penalised, params, output_ids, prompt_ids, vocab_size, device) if penalised else None
        )

        banned = [sorted(t for t in ids if t < vocab_size) for ids in stop_ids_suppressed]
        suppressed = _flat_ids(banned, device) if any(banned) else None

        asked = any(p.logprobs is not None for p in params)
        logprobs_k = tuple(p.logprobs or 0 for p in params) if asked else None
        constraints = _TokenConstraints.build(params, output_ids, vocab_size, device)
        return cls(vocab_size, sampled, penalties, suppressed, logprobs_k, allowed, constraints)


def apply_grammar_masks_(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """Sets in place every logit of `rows` of `logits` [B, V] that `allowed` [len(rows), V] does not
    allow to -inf; other rows are untouched."""
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))


class SamplerOutput(NamedTuple):
    """One step's result, per row in batch order."""

    token_ids: list[int]
    # Raw logprob of the sampled token for every row; None iff no row asked for logprobs.
    logprobs: list[float] | None
    # Per row the k most likely (id, raw logprob), descending, k = that row's `params.logprobs`
    # (empty for rows that asked none); None iff no row asked for logprobs.
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Stateless: turns one step's logits and its `SamplingBatch` into tokens."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """`logits` [B, >= vocab_size] float; never modified."""
        raw = logits[:, : batch.vocab_size].float()
        logits = raw
        if (batch.penalties is not None or batch.suppressed is not None or batch.allowed is not None
                or batch.constraints is not None):
            logits = raw.clone()
            if batch.penalties is not None:
                batch.penalties.apply_(logits)
            if batch.constraints is not None:
                batch.constraints.apply_(logits)
            if batch.suppressed is not None:
                logits[batch.suppressed] = float("-inf")
            if batch.allowed is not None:
                apply_grammar_masks_(logits, *batch.allowed)

        tokens = logits.argmax(dim=-1)
        if batch.sampled is not None:
            tokens[batch.sampled.rows] = batch.sampled.sample(logits)
        token_ids = tokens.tolist()
        if batch.logprobs_k is None:
            return SamplerOutput(token_ids, None, None)

        raw_logprobs = torch.log_softmax(raw, dim=-1)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        k_max = max(batch.logprobs_k)
        if k_max == 0:
            return SamplerOutput(token_ids, chosen, [[] for _ in token_ids])
        values, ids = raw_logprobs.topk(k_max, dim=-1)
        top = [
            list(zip(row_ids[:k], row_values[:k], strict=True))
            for k, row_ids, row_values in zip(batch.logprobs_k, ids.tolist(), values.tolist(), strict=True)
        ]
        return SamplerOutput(token_ids, chosen, top)
