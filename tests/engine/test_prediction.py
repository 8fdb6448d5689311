"""Predicted Outputs (`nanoserve.engine.prediction`): the prediction's tokens as drafts, verified
exactly. Output equal to plain decoding (itself tested against transformers) whatever the
prediction; drafts accepted where the prediction is right, re-synchronised after an edit; every
block returned."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.prediction import PredictionProposer, match
from nanoserve.engine.sequence import Sequence
from nanoserve.model import load_model
from nanoserve.runtime.stand_in import stand_in_engine, stand_in_generate


def _brute_force_match(prediction: list[int], tokens: list[int], hint: int, max_n: int, min_n: int) -> int | None:
    """`match` by its definition: the longest suffix of `tokens` (min_n <= n <= max_n) occurring
    in the prediction; after its first occurrence ending at or after hint - 1, else after its last."""
    for n in range(min(max_n, len(tokens)), 0, -1):
        if n < min_n:
            return None
        ends = [e for e in range(n - 1, len(prediction)) if prediction[e - n + 1 : e + 1] == tokens[-n:]]
        if ends:
            ahead = [e for e in ends if e >= hint - 1]
            return (ahead[0] if ahead else ends[-1]) + 1
    return None


@pytest.mark.parametrize(("max_n", "min_n"), [(1, 1), (3, 1), (16, 1), (16, 2), (4, 3)])
def test_match_follows_its_definition(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    for _ in range(500):
        vocab = rng.choice([2, 3, 8])
        prediction = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        hint = rng.randrange(len(prediction) + 1)
        got = match(np.asarray(prediction, dtype=np.int64), tokens, hint, max_n, min_n)
        assert got == _brute_force_match(prediction, tokens, hint, max_n, min_n)


def test_cursor_follows_the_output_and_resyncs_after_an_edit():
    """Drafts continue the prediction while the output follows it; after an edit (tokens not in the
    prediction) the first two tokens that match again put the drafts back on the prediction's text
    (one alone does not: min_n = 2)."""
    prediction = list(range(100, 130))
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=64, prediction_token_ids=prediction), 0)
    proposer = PredictionProposer()

    def step(*tokens: int) -> list[int]:
        for t in tokens:
            seq.append_token(t)
        return proposer.propose([seq], [4])[0].tokens

    assert step(100) == [101, 102, 103, 104]
    proposer.accepted(seq, 4)  # 101-104 accepted, then the target's own 105
    assert step(101, 102, 103, 104, 105) == [106, 107, 108, 109]
    proposer.accepted(seq, 1)  # 106 accepted, then an edit: 7 instead of 107
    assert step(106, 7) == []  # 7 is nowhere in the prediction
    assert step(8) == []
    assert step(110) == []  # one token of the prediction: not yet
    assert step(111) == [112, 113, 114, 115]  # back on the prediction after the edit
    proposer.release(seq)
    assert not proposer._cursors


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_edited_predictions_are_exact_on_the_stand_in(block_size):
    """Twelve requests at once, each predicted by its own answer with small edits, on an engine
    without a proposer: outputs equal the stand-in's reference, most drafts accepted, blocks
    rolled back after rejections and all returned. A text prediction needs a tokenizer."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(64) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    engine = stand_in_engine(vocab_size=64, block_size=block_size, num_kv_blocks=400, max_model_len=128)
    assert engine.proposer is None
    answers = [stand_in_generate(p, 40, 64) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prediction_token_ids=_edited(a, rng))
              for a in answers]
    outputs, accepted, rejected = _run(engine, prompts, params)
    assert outputs == answers
    # At most 4 in 5 of the 39 tokens after the first are accepted drafts (k = 4), less a few
    # around each of the three edits.
    assert accepted > 0.4 * 40 * len(prompts) and rejected > 0
    with pytest.raises(ValueError, match="prediction needs a tokenizer"):
        engine.add_request("text", [1, 2], SamplingParams(prediction="some text"))


@pytest.fixture(scope="module")
def target(make_checkpoint):
    return load_model(make_checkpoint("llama"), dtype=torch.float32)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], int, int]:
    """Every request's output tokens, and the accepted and rejected prediction tokens over all."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    accepted = rejected = 0
    while engine.has_unfinished():
        for d in engine.step().deltas:
            outputs[d.request_id] += d.token_ids
            accepted += d.accepted_prediction_tokens
            rejected += d.rejected_prediction_tokens
    assert engine.kv_stats().blocks_used == 0
    return [outputs[str(i)] for i in range(len(prompts))], accepted, rejected


def _edited(tokens: list[int], rng: random.Random) -> list[int]:
    """`tokens` with a few small edits: a token replaced, two inserted, one deleted."""
    out = list(tokens)
    out[len(out) // 5] = 3
    out[len(out) // 2 : len(out) // 2] = [4, 5]
    del out[(3 * len(out)) // 4]
    return out


@pytest.mark.parametrize("spec", ["none", "ngram", "draft"])
def test_greedy_output_is_the_same_whatever_the_prediction(target, make_checkpoint, spec):
    """Greedy, several requests batched, with and without a server-wide proposer (n-gram, or a
    draft model that drafts where the prediction has nothing to offer and catches up after): a
    prediction equal to the output is accepted almost whole; an edited one is accepted after each
    edit again; a wrong one only costs rejections. Every output equals plain decoding's; every
    block returns, the draft model's too."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 33)]
    max_tokens = 48
    plain_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=target, max_model_len=256).generate(prompts, plain_params)]
    spec_args = {"none": {}, "ngram": {"speculative_method": "ngram"},
                 "draft": {"speculative_model": str(make_checkpoint("llama", num_hidden_layers=1))}}[spec]
    engine = LLM(loaded=target, max_model_len=256, block_size=4, **spec_args).engine
    assert (engine.proposer is None) == (spec == "none")

    def with_prediction(predictions: list[list[int]]) -> tuple[list[list[int]], int, int]:
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prediction_token_ids=p)
                  for p in predictions]
        return _run(engine, prompts, params)

    exact, accepted, rejected = with_prediction(plain)
    assert exact == plain
    # After the first token, each verification yields its k = 4 accepted drafts and the target's own.
    assert accepted >= 0.75 * sum(len(p) - 1 for p in plain) and rejected <= 3

    edited, accepted, _ = with_prediction([_edited(p, rng) for p in plain])
    assert edited == plain
    # Each edit stops the drafts for a token or a few; the text after the last one is accepted.
    assert accepted >= 0.6 * sum(len(p) for p in plain)

    # The output backwards: its tokens are found, what follows them there is mostly wrong.
    wrong, accepted, rejected = with_prediction([p[::-1] for p in plain])
    assert wrong == plain
    assert rejected > max(accepted, 10)
    if spec == "draft":
        draft_pool = engine.proposer.kv.pool  # type: ignore[union-attr]
        assert draft_pool.num_free == draft_pool.num_blocks


def test_constrained_sequences_get_no_prediction_drafts(target):
    """Structured output keeps its rule (no drafts: its mask would have to follow each draft): a
    prediction changes nothing, and counts nothing."""
    from nanoserve.engine.sampling_params import StructuredOutputs

    engine = LLM(loaded=target, max_model_len=128).engine
    regex = StructuredOutputs(regex="[a-z]{20}")
    (plain,), _, _ = _run(engine, [[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=24, structured=regex)])
    params = SamplingParams(temperature=0, max_tokens=24, structured=regex, prediction_token_ids=plain)
    (out,), accepted, rejected = _run(engine, [[5, 6, 7]], [params])
    assert out == plain and len(plain) > 2  # decode steps that would have drafted
    assert accepted == rejected == engine.spec_stats.proposed == 0


@pytest.mark.slow
def test_sampled_output_keeps_the_target_distribution(target):
    """Temperature 1, top-k 3: the second token comes out of verifying a prediction draft (right
    for some first tokens, wrong for others), and the joint distribution of the first two tokens
    matches the target's, computed exactly with transformers (chi-square over 500 requests)."""
    import transformers

    prompt = [11, 22, 33, 44, 55]

    def topk_probs(logits: torch.Tensor) -> dict[int, float]:
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
    with torch.no_grad():
        first = topk_probs(hf(torch.tensor([prompt])).logits[0, -1])
        second = {a: topk_probs(hf(torch.tensor([[*prompt, a]])).logits[0, -1]) for a in first}
    joint = {(a, b): pa * pb for a, pa in first.items() for b, pb in second[a].items()}
    # After the prompt's last token and each likely first token, the prediction goes on with a
    # likely second one (the most likely after the first, the least likely after the others):
    # accepted, rejected, or replaced.
    prediction: list[int] = []
    for i, a in enumerate(first):
        ranked = sorted(second[a], key=second[a].__getitem__, reverse=True)
        prediction += [prompt[-1], a, ranked[0] if i == 0 else ranked[-1]]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, prediction_token_ids=prediction)
    engine = LLM(loaded=target, max_model_len=64, max_num_seqs=512, seed=1).engine
    outs, accepted, rejected = _run(engine, [prompt] * 500, [params] * 500)
    assert engine.spec_stats.verifications >= 500 and accepted > 0 and rejected > 0
    keys = list(joint)
    counts = torch.zeros(len(keys))
    for o in outs:
        counts[keys.index(tuple(o[:2]))] += 1
    expected = torch.tensor([joint[k] for k in keys]) * len(outs)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 26.12  # chi-square, 8 degrees of freedom, p = 0.001


def test_prediction_text_is_tokenized_and_composes_with_the_limits(target):
    """A text prediction is tokenized by the engine; max_tokens shorter than the prediction stops
    the output at its length, drafts never running past it."""
    llm = LLM(loaded=target, max_model_len=128)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    text = llm.engine.tokenizer.decode(plain)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prediction=text)
    (out,), accepted, _ = _run(llm.engine, [prompt], [params])
    assert out == plain[:10]
    assert params.prediction_token_ids is not None and accepted <= 9


def test_prediction_token_ids_out_of_the_vocabulary_are_refused(target):
    engine = LLM(loaded=target, max_model_len=128).engine
    bad = SamplingParams(temperature=0, max_tokens=4, prediction_token_ids=[5, engine.vocab_size])
    with pytest.raises(ValueError, match="prediction token ids must be in"):
        engine.add_request("r", [1, 2, 3], bad)
    assert not engine.has_unfinished()
