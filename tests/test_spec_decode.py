"""Speculative decoding: the accept/reject rule, the proposers, and exactness end to end."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.spec_decode import NgramProposer, verify
from nanoserve.engine.stand_in import stand_in_engine, stand_in_generate
from nanoserve.model import load_model

# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_999 = {5: 20.52, 8: 26.12}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("point_mass", [False, True])
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
        out = verify(target, [d], None if point_mass else q[None], gen)
        counts[out[0]] += 1
    assert _chi2(counts, p) < CHI2_999[5]
    # The same statistic does tell a wrong distribution apart.
    assert _chi2(counts, q) > 10 * CHI2_999[5]


def test_greedy_verification_keeps_the_argmax_prefix():
    target = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 1]), 6).float()
    assert verify(target, [3, 1, 4], None, None) == [3, 1, 4, 1]
    assert verify(target, [3, 2, 4], None, None) == [3, 1]
    assert verify(target, [0, 1, 4], None, None) == [3]


def test_ngram_lookup_proposes_the_latest_continuation():
    ngram = NgramProposer(max_n=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    # In a loop the latest match is followed by too few tokens; the proposal still fills k.
    assert ngram.lookup([4, 5, 4, 5, 4, 5], 3) == [4, 5, 4]
    assert ngram.lookup([5, 6, 7, 5], 3) == [6, 7, 5]
    assert ngram.lookup([1, 2, 3, 4], 3) == []


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
        for d in engine.step():
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


@pytest.mark.parametrize("method", ["ngram", "self-draft", "other-draft"])
def test_greedy_speculation_equals_plain_greedy(target_and_draft, method):
    """Exact output whatever the drafts: the target itself as its draft (every draft accepted), a
    draft that is mostly wrong (rejections and rollbacks), and prompt lookup."""
    target, draft_path = target_and_draft
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 33)]
    prompts.append([7, 8, 9, 10] * 6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(loaded=target, max_model_len=128).generate(prompts, params)
    spec_args = {"ngram": {"speculative_method": "ngram"}, "self-draft": {"speculative_model": str(target.path)},
                 "other-draft": {"speculative_model": str(draft_path)}}[method]
    llm = LLM(loaded=target, max_model_len=128, block_size=4, num_speculative_tokens=3, **spec_args)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec_stats
    assert stats.proposed > 0 and stats.proposed >= stats.accepted
    if method == "self-draft":
        assert stats.accepted == stats.proposed
    if method == "ngram":
        assert stats.accepted > 0
    assert llm.engine.kv_stats().blocks_used == 0
    if method != "ngram":
        draft_pool = llm.engine.proposer.kv.pool
        assert draft_pool.num_free == draft_pool.num_blocks


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
    outs = llm.generate([prompt] * 500, params)
    keys = list(joint)
    counts = torch.zeros(len(keys))
    for o in outs:
        counts[keys.index(tuple(o.outputs[0].token_ids[:2]))] += 1
    assert llm.engine.spec_stats.verifications >= 500
    assert _chi2(counts, torch.tensor([joint[k] for k in keys])) < CHI2_999[8]
