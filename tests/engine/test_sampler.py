"""Sampler tests: each behaviour against a plain per-row reference written here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from nanoserve.engine.sampler import Sampler, SamplingBatch, _top_p_floor
from nanoserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Upper 1e-4 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_1E4 = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878}


def make_batch(
    params: Sequence[SamplingParams],
    vocab_size: int,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    suppressed: Sequence[frozenset[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        outputs if outputs is not None else [[]] * n,
        prompts if prompts is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        vocab_size,
        CPU,
        suppressed if suppressed is not None else [frozenset()] * n,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device=CPU).manual_seed(seed)


def reference_penalised(
    logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """One row, token by token: repetition on prompt+output, then frequency and presence on output."""
    out = logits.double().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution: temperature, then top-k, top-p, min-p, each renormalised."""
    vocab = logits.numel()
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True).tolist()
    allowed = order[: p.top_k] if p.top_k > 0 else order
    mass_k = float(probs[allowed].sum())
    kept, mass = [], 0.0
    for t in allowed:
        kept.append(t)
        mass += float(probs[t]) / mass_k
        if mass >= p.top_p:
            break
    kept = [t for t in kept if probs[t] >= p.min_p * probs[order[0]]]
    out = torch.zeros(vocab, dtype=torch.float64)
    out[kept] = probs[kept]
    return out / out.sum()


def describe(p: SamplingParams) -> str:
    """A short test id."""
    return f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}-r{p.repetition_penalty}"


def test_greedy_is_argmax_and_builds_nothing() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[5, [7, 3, 30]] = 9.0  # a tie: the lowest id wins
    batch = make_batch([SamplingParams(temperature=0.0)] * 6, 50)
    assert batch.sampled is None and batch.penalties is None and batch.suppressed is None
    out = Sampler()(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[5] == 3
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_with_penalties_matches_reference() -> None:
    torch.manual_seed(1)
    rows, vocab = 60, 20
    logits = torch.randn(rows, vocab) * 2
    logits[::2] -= 6.0  # rows of mostly negative logits, where repetition multiplies
    params, prompts, outputs = [], [], []
    for _ in range(rows):
        rep, freq, pres = torch.rand(3).tolist()
        params.append(
            SamplingParams(
                temperature=0.0,
                repetition_penalty=0.5 + 1.5 * rep,
                frequency_penalty=4 * freq - 2,
                presence_penalty=4 * pres - 2,
            )
        )
        prompts.append(torch.randint(0, vocab, (int(torch.randint(0, 8, ())),)).tolist())
        # Few distinct output ids, so counts above one are common.
        outputs.append(torch.randint(0, 6, (int(torch.randint(0, 12, ())),)).tolist())
    params[0] = SamplingParams(temperature=0.0)  # an unpenalised row in the same batch
    before = logits.clone()
    out = Sampler()(logits, make_batch(params, vocab, outputs, prompts))
    expected = [int(reference_penalised(logits[i], params[i], prompts[i], outputs[i]).argmax()) for i in range(rows)]
    assert out.token_ids == expected
    assert torch.equal(logits, before), "the caller's logits must not change"
    changed = sum(e != a for e, a in zip(expected, logits.argmax(-1).tolist(), strict=True))
    assert changed >= 10, "penalties should change the argmax of many rows here"


FILTER_CASES = [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.5, min_p=0.2),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=0.5, top_k=1),
]


@pytest.mark.parametrize("params", FILTER_CASES, ids=describe)
def test_filtered_samples_stay_in_allowed_set(params: SamplingParams) -> None:
    torch.manual_seed(2)
    rows, vocab = 400, 12
    logits = torch.randn(rows, vocab) * 2
    allowed = [reference_distribution(row, params) > 0 for row in logits]
    batch = make_batch([params] * rows, vocab)
    for _ in range(3):
        out = Sampler()(logits, batch)
        for i, token in enumerate(out.token_ids):
            assert allowed[i][token], (i, token)


def test_ties_at_a_filter_boundary_are_all_kept() -> None:
    torch.manual_seed(10)
    logits = torch.tensor([3.0, 3.0, 0.0, -1.0]).expand(2000, -1).contiguous()
    out = Sampler()(logits, make_batch([SamplingParams(temperature=1.0, top_k=1)] * 2000, 4))
    assert set(out.token_ids) == {0, 1}


def test_build_rejects_rows_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        SamplingBatch.build([SamplingParams()] * 2, [[]], [[]] * 2, [None] * 2, 8, CPU, [frozenset()] * 2)


def test_top_p_floor_widens_past_the_first_candidates() -> None:
    torch.manual_seed(9)
    vocab = 5000
    # Flat rows need most of the vocabulary (several widenings); the peaked row only a few tokens.
    scales = torch.tensor([[0.05], [1.0], [6.0], [1.0], [0.05]])
    top_p = torch.tensor([[0.9], [0.5], [0.9], [1.0], [0.999]])
    probs = torch.softmax(torch.randn(len(scales), vocab) * scales, dim=-1)
    floor = _top_p_floor(probs, top_p)
    for row in range(len(scales)):
        ordered = probs[row].double().sort(descending=True).values
        reached = ordered.cumsum(0) >= float(top_p[row]) * ordered.sum()
        want_kept = vocab if top_p[row] >= 1 else int(reached.int().argmax()) + 1
        assert int((probs[row] >= floor[row]).sum()) == want_kept, row
    assert int((probs[0] >= floor[0]).sum()) > 4096 and int((probs[2] >= floor[2]).sum()) < 256


def test_top_p_floor_on_a_large_vocabulary_with_ties() -> None:
    """Qwen-sized rows past the first candidates (the radix path): the kept count equals a float64
    sort's, and values tied with the last kept one are all kept."""
    torch.manual_seed(3)
    vocab = 151936
    logits = torch.randn(3, vocab) * torch.tensor([[1.25], [3.0], [1.0]])
    logits[2] -= 5.0
    logits[2, :5000] = 4.0  # 5,000 tied values above the rest, holding 99% of row 2's mass
    probs = torch.softmax(logits, dim=-1)
    top_p = torch.tensor([[0.9], [0.95], [0.5]])
    floor = _top_p_floor(probs, top_p)
    for row in range(3):
        ordered = probs[row].double().sort(descending=True).values
        want = int((ordered.cumsum(0) >= float(top_p[row]) * ordered.sum()).int().argmax()) + 1
        kept = int((probs[row] >= floor[row]).sum())
        assert kept == (5000 if row == 2 else want), row
    assert float(floor[2]) == float(probs[2, 0])


# Distinct, well separated logits: no filter boundary lies within rounding distance.
CHI2_LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.5])
CHI2_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.85),
    SamplingParams(temperature=1.2, min_p=0.12),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.3),
]


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the bins of positive expected probability, and its degrees of freedom."""
    n = counts.sum()
    bins = expected > 0
    e = n * expected[bins]
    return float(((counts[bins] - e) ** 2 / e).sum()), int(bins.sum()) - 1


@pytest.mark.parametrize("params", CHI2_CASES, ids=describe)
def test_empirical_distribution_matches_reference(params: SamplingParams) -> None:
    torch.manual_seed(3)
    draws = 20_000
    logits = CHI2_LOGITS.expand(draws, -1).contiguous()
    out = Sampler()(logits, make_batch([params] * draws, logits.shape[1]))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[1]).double()
    expected = reference_distribution(CHI2_LOGITS, params)
    assert counts[expected == 0].sum() == 0
    statistic, dof = chi_square(counts, expected)
    assert dof >= 2
    assert statistic < CHI2_CRITICAL_1E4[dof], (statistic, counts.tolist(), expected.tolist())
    # The test has power: swapping the two most likely tokens' probabilities is detected.
    swapped = expected.clone()
    swapped[[0, 1]] = expected[[1, 0]]
    assert chi_square(counts, swapped)[0] > CHI2_CRITICAL_1E4[dof]


def run_steps(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None],
    suppressed: Sequence[frozenset[int]] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[torch.Generator | None]]:
    """Decodes `logits` [steps, B, V] step by step; each row's output feeds its penalties."""
    gens = [None if s is None else seeded(s) for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    logprobs: list[list[float]] = [[] for _ in params]
    prompts = [[1, 2, 3]] * len(params)
    for step in logits:
        batch = make_batch(params, step.shape[1], outputs, prompts, gens, suppressed)
        out = Sampler()(step, batch)
        for row, token in enumerate(out.token_ids):
            outputs[row].append(token)
            if out.logprobs is not None:
                logprobs[row].append(out.logprobs[row])
    return outputs, logprobs, gens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1234),
        SamplingParams(temperature=1.1, top_k=20, top_p=0.9, seed=1234),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=1234),
    ],
    ids=describe,
)
def test_seeded_row_same_alone_and_in_batch(params: SamplingParams) -> None:
    torch.manual_seed(4)
    steps, vocab = 8, 64
    logits = torch.randn(steps, 6, vocab)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5, seed=7),
        SamplingParams(temperature=1.3, min_p=0.1),
        SamplingParams(temperature=0.7, top_p=0.5, frequency_penalty=1.0),
    ]
    alone, _, (gen_alone,) = run_steps(logits[:, 2:3], [params], [1234])
    mixed_params = [*others[:2], params, *others[2:]]
    mixed, _, gens = run_steps(logits, mixed_params, [None, None, 1234, 7, None, None])
    assert mixed[2] == alone[0]
    assert gen_alone is not None and gens[2] is not None
    assert torch.equal(gen_alone.get_state(), gens[2].get_state()), "one draw per step, batch or not"
    other_seed, _, _ = run_steps(logits[:, 2:3], [params], [4321])
    assert other_seed[0] != alone[0]


def test_suppressed_ids_never_emitted() -> None:
    torch.manual_seed(5)
    rows, vocab = 300, 16
    logits = torch.randn(rows, vocab)
    logits[:, [3, 7]] += 20.0  # by far the likeliest tokens
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=2.0, min_p=0.5),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    banned = frozenset({3, 7, 999})  # ids past the vocabulary are ignored
    suppressed = [banned] * (rows - 1) + [frozenset()]
    out = Sampler()(logits, make_batch(params, vocab, suppressed=suppressed))
    assert not {3, 7} & set(out.token_ids[:-1])
    assert out.token_ids[-1] in {3, 7}, "the row without suppression is unaffected"


def test_logprobs_are_raw_and_per_row() -> None:
    torch.manual_seed(6)
    vocab = 50
    params = [
        SamplingParams(temperature=0.0, logprobs=None),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.8),
        SamplingParams(temperature=0.5, logprobs=3, top_k=4),
        SamplingParams(temperature=1.5, logprobs=20, presence_penalty=2.0, min_p=0.1),
        SamplingParams(temperature=1.0, logprobs=1),
    ]
    logits = torch.randn(len(params), vocab) * 3
    out = Sampler()(logits, make_batch(params, vocab, outputs=[[0, 1, 2]] * len(params)))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, (p, token) in enumerate(zip(params, out.token_ids, strict=True)):
        assert out.logprobs[row] == pytest.approx(float(raw[row, token]), abs=1e-6)
        top = out.top_logprobs[row]
        assert len(top) == (p.logprobs or 0)
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        want_values, want_ids = raw[row].topk(len(top))
        assert [t for t, _ in top] == want_ids.tolist()
        assert values == pytest.approx(want_values.tolist(), abs=1e-6)


def test_mixed_batch_rows_match_rows_alone() -> None:
    torch.manual_seed(7)
    steps, vocab = 6, 40
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.8, presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=1.2, top_k=10, top_p=0.8, min_p=0.05, repetition_penalty=1.2, seed=12),
        SamplingParams(temperature=1.0),  # unseeded: nothing to compare, but it shares the batch
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.3, logprobs=2, presence_penalty=1.0, seed=13),
    ]
    seeds = [p.seed for p in params]
    suppressed = [frozenset({5, 6}) if i in (5, 6) else frozenset() for i in range(len(params))]
    logits = torch.randn(steps, len(params), vocab) * 2
    mixed, mixed_logprobs, _ = run_steps(logits, params, seeds, suppressed)
    for row, p in enumerate(params):
        if p.seed is None and not p.greedy:
            continue
        alone, alone_logprobs, _ = run_steps(logits[:, row : row + 1], [p], [p.seed], [suppressed[row]])
        assert mixed[row] == alone[0], row
        if p.logprobs is not None:
            assert mixed_logprobs[row] == alone_logprobs[0], row
        assert not suppressed[row] & set(mixed[row])


def test_logit_columns_past_vocab_size_are_ignored() -> None:
    torch.manual_seed(8)
    vocab, padded = 30, 36
    logits = torch.randn(4, padded)
    logits[:, vocab:] = 50.0  # padding of the LM head must never win
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ]
    out = Sampler()(logits, make_batch(params, vocab, outputs=[[29]] * 4))
    assert all(0 <= t < vocab for t in out.token_ids)
    assert out.logprobs is not None
    raw = torch.log_softmax(logits[:, :vocab], dim=-1)
    assert out.logprobs[0] == pytest.approx(float(raw[0, out.token_ids[0]]), abs=1e-6)
