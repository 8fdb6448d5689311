"""Speculative decoding: the accept/reject rule, the proposers, and exactness end to end."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.spec_decode import NgramProposer, verify, verify_greedy
from nanoserve.model import load_model
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.runtime.stand_in import stand_in_engine, stand_in_generate

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {5: 20.52, 8: 26.12}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.slow
def test_rejection_rule_preserves_the_target_distribution(point_mass):
    """Drafts drawn from q, kept or replaced by `verify`: the first output token follows p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    bonus = torch.full((6,), 1 / 6)
    target = torch.stack([p, bonus])
    trials = 12000
    draws = torch.multinomial(q, trials, replacement=True, generator=gen).tolist()
    counts = torch.zeros(6)
    for d in draws:
        # n-gram style when point_mass: the draft is given, q is a point mass on it
        out = verify(target, [[d]], [None if point_mass else q[None]], [gen])[0]
        counts[out[0]] += 1
    assert _chi2(counts, p) < CHI2_999[5]
    # The same statistic does tell a wrong distribution apart.
    assert _chi2(counts, q) > 10 * CHI2_999[5]


def test_greedy_verification_keeps_the_argmax_prefix():
    target = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 1]), 6).float()
    assert verify(target, [[3, 1, 4]], [None], [None]) == [[3, 1, 4, 1]]
    assert verify(target, [[3, 2, 4]], [None], [None]) == [[3, 1]]
    assert verify(target, [[0, 1, 4]], [None], [None]) == [[3]]


def test_ngram_lookup_proposes_the_latest_continuation():
    ngram = NgramProposer(max_n=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    # In a loop the latest match is followed by too few tokens; the proposal still fills k.
    assert ngram.lookup([4, 5, 4, 5, 4, 5], 3) == [4, 5, 4]
    assert ngram.lookup([5, 6, 7, 5], 3) == [6, 7, 5]
    assert ngram.lookup([1, 2, 3, 4], 3) == []


def test_batched_verification_equals_one_sequence_at_a_time():
    """A batch mixing point-mass and sampled drafts of several lengths keeps, per seeded sequence,
    exactly what verifying that sequence alone keeps: rows, draws and residuals never mix."""
    rng = random.Random(7)
    vocab = 5
    for trial in range(60):
        lengths = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))]
        targets = torch.softmax(3 * torch.randn(sum(k + 1 for k in lengths), vocab), dim=-1)
        drafts = [[rng.randrange(vocab) for _ in range(k)] for k in lengths]
        probs = [None if rng.random() < 0.5 else torch.softmax(torch.randn(k, vocab), dim=-1) for k in lengths]
        if trial % 3 == 0:  # q == p with p(d) = 0: d is rejected, max(p - q, 0) is empty, p is drawn from
            targets[0, drafts[0][0]] = 0.0
            probs[0] = targets[: lengths[0]].clone()
        seeds = [rng.randrange(2**31) for _ in lengths]
        batched = verify(targets, drafts, probs, [torch.Generator().manual_seed(x) for x in seeds])
        alone, row = [], 0
        for k, d, q, seed in zip(lengths, drafts, probs, seeds, strict=True):
            alone += verify(targets[row : row + k + 1], [d], [q], [torch.Generator().manual_seed(seed)])
            row += k + 1
        assert batched == alone


def test_greedy_fast_path_equals_the_rejection_rule():
    """`verify_greedy` (argmax ids only) keeps exactly what `verify` keeps on one-hot targets."""
    rng = random.Random(5)
    for _ in range(300):
        k = rng.randrange(1, 6)
        argmax = [rng.randrange(3) for _ in range(k + 1)]
        drafts = [rng.randrange(3) for _ in range(k)]
        target = torch.nn.functional.one_hot(torch.tensor(argmax), 3).float()
        assert verify_greedy(argmax, drafts) == verify(target, [drafts], [None], [None])[0]


def _brute_force_continuation(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The n-gram rule by its definition: the longest n (max_n down to min_n) whose last-n suffix
    occurs earlier (a window ending before the last token); what follows its latest occurrence that
    has k tokens after it, else its earliest occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [p for p in range(len(tokens) - n) if tokens[p : p + n] == tokens[-n:]]
        if starts:
            full = [p for p in starts if p + n + k <= len(tokens)]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start : start + k]
    return []


@pytest.mark.parametrize(("max_n", "min_n"), [(4, 1), (3, 2), (1, 1)])
def test_ngram_continuation_follows_its_definition(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    ngram = NgramProposer(max_n=max_n, min_n=min_n)
    for _ in range(400):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert ngram._continuation(tokens, k) == _brute_force_continuation(tokens, k, max_n, min_n)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_ngram_speculation_is_exact_on_the_stand_in(block_size):
    """Repetitive prompts make the n-gram proposer draft often; every output must still equal the
    stand-in's reference generation, with blocks rolled back after rejections."""
    rng = random.Random(block_size)
    prompts = []
    for _ in range(12):
        unit = [rng.randrange(50) for _ in range(rng.randrange(2, 6))]
        prompts.append((unit * 20)[: rng.randrange(8, 60)])
    engine = stand_in_engine(vocab_size=64, block_size=block_size, speculative_method="ngram",
                             num_speculative_tokens=3, num_kv_blocks=400, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step().deltas:
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
    for i, p in enumerate(prompts):
        assert outputs[str(i)] == stand_in_generate(p, 24, 64)
    assert engine.spec_stats.proposed > 0
    assert engine.kv_stats().blocks_used == 0


@pytest.fixture(scope="module")
def target_and_draft(make_checkpoint):
    target = load_model(make_checkpoint("llama"), dtype=torch.float32)
    # The same seed and one layer fewer: random weights, so it mostly disagrees with the target.
    draft_path = make_checkpoint("llama", num_hidden_layers=1)
    return target, draft_path


@pytest.mark.parametrize(("method", "min_confidence"), [
    ("ngram", None), ("self-draft", 0.0), ("self-draft", 0.003), ("other-draft", 0.0), ("other-draft", 0.003),
])
@pytest.mark.slow
def test_greedy_speculation_equals_plain_greedy(target_and_draft, method, min_confidence):
    """Exact output whatever the drafts: the target itself as its draft (every draft accepted), a
    draft that is mostly wrong (rejections and rollbacks), and prompt lookup; a draft model drafting
    its whole budget (min_confidence 0) or stopping early where unsure."""
    target, draft_path = target_and_draft
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 33)]
    prompts.append([7, 8, 9, 10] * 6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(loaded=target, max_model_len=128).generate(prompts, params)
    spec_args = {"ngram": {"speculative_method": "ngram"},
                 "self-draft": {"speculative_model": str(target.path), "speculative_dtype": "float32"},
                 "other-draft": {"speculative_model": str(draft_path)}}[method]
    llm = LLM(loaded=target, max_model_len=128, block_size=4, num_speculative_tokens=3, **spec_args)
    if min_confidence is not None:
        llm.engine.proposer.min_confidence = min_confidence
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec_stats
    assert stats.proposed > 0 and stats.proposed >= stats.accepted
    if method == "self-draft":
        assert stats.accepted == stats.proposed
    if method == "ngram":
        assert stats.accepted > 0
    per_verification = stats.proposed / stats.verifications
    if min_confidence == 0.0:  # the whole budget (3) but near max_tokens
        assert per_verification > 2.5
    elif min_confidence is not None:  # random weights: top probabilities of a few thousandths, so a mix
        assert 1.0 < per_verification < 2.5
    assert llm.engine.kv_stats().blocks_used == 0
    if method != "ngram":
        draft_pool = llm.engine.proposer.kv.pool
        assert draft_pool.num_free == draft_pool.num_blocks


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_draft_dtype(target_and_draft, dtype):
    """The draft runs in the dtype asked for; 'auto' is bf16 where the (fp32) target runs on the C++
    CPU kernels, else the target's. The output stays the plain target's."""
    target, draft_path = target_and_draft
    prompts = [[5, 6, 7, 8, 9], list(range(40, 57))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(loaded=target, max_model_len=128).generate(prompts, params)
    llm = LLM(loaded=target, max_model_len=128, speculative_model=str(draft_path), speculative_dtype=dtype)
    expected = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if expected is None:
        expected = torch.bfloat16 if isinstance(target.model.ops, CpuLayerOps) else torch.float32
    draft_runner = llm.engine.proposer.runner
    assert draft_runner.model.dtype == expected and draft_runner.kv_cache.dtype == expected
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec_stats.proposed > 0


def test_no_drafts_while_the_batch_is_over_the_limit(target_and_draft):
    """speculative_disable_by_batch_size=1: no draft while two or three requests run; drafts again
    once the longest runs alone (the draft model first catching up on the tokens it missed); the
    output is the plain target's throughout."""
    target, draft_path = target_and_draft
    prompts = [[5, 6, 7, 8, 9], list(range(40, 57)), [3] * 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 10, 30)]
    plain = LLM(loaded=target, max_model_len=128).generate(prompts, params)
    llm = LLM(loaded=target, max_model_len=128, speculative_model=str(draft_path),
              speculative_disable_by_batch_size=1)
    engine, propose = llm.engine, llm.engine.proposer.propose
    batches: list[int] = []

    def recorded(requests, budgets):
        batches.append(len(engine.scheduler.running))
        return propose(requests, budgets)

    engine.proposer.propose = recorded
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert batches and set(batches) == {1}
    assert engine.spec_stats.proposed > 0
    with pytest.raises(ValueError, match="at least 1"):
        LLM(loaded=target, speculative_model=str(draft_path), speculative_disable_by_batch_size=0)


@pytest.mark.slow
def test_sampled_speculation_matches_the_target_distribution(target_and_draft):
    """Temperature 1, top-k 3: the joint distribution of the first two tokens, the second of which
    comes out of draft verification, matches the target's exactly computed one (chi-square)."""
    target, draft_path = target_and_draft
    prompt = [11, 22, 33, 44, 55]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)

    def topk_probs(logits: torch.Tensor) -> dict[int, float]:
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = topk_probs(hf(torch.tensor([prompt])).logits[0, -1])
        joint = {(a, b): pa * pb for a, pa in first.items()
                 for b, pb in topk_probs(hf(torch.tensor([[*prompt, a]])).logits[0, -1]).items()}
    llm = LLM(loaded=target, max_model_len=64, max_num_seqs=512, speculative_model=str(draft_path),
              num_speculative_tokens=2, seed=1)
    llm.engine.proposer.min_confidence = 0.0  # both drafts every time: random weights are never confident
    outs = llm.generate([prompt] * 500, params)
    keys = list(joint)
    counts = torch.zeros(len(keys))
    for o in outs:
        counts[keys.index(tuple(o.outputs[0].token_ids[:2]))] += 1
    assert llm.engine.spec_stats.verifications >= 500
    assert _chi2(counts, torch.tensor([joint[k] for k in keys])) < CHI2_999[8]


def test_speculation_arguments_are_checked() -> None:
    from nanoserve.engine.args import EngineArgs

    for bad, words in ((dict(num_speculative_tokens=0), "at least 1"),
                       (dict(speculative_min_confidence=1.5), "speculative_min_confidence"),
                       (dict(speculative_method="eagle"), "ngram or draft"),
                       (dict(speculative_method="draft"), "needs a draft model")):
        with pytest.raises(ValueError, match=words):
            EngineArgs(**bad)
