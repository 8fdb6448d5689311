"""The engine end to end on real (tiny, random) checkpoints, against transformers' greedy output."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.args import EngineArgs
from nanoserve.model import load_model
from nanoserve.runtime.builder import build_engine

from support.families import FAMILIES

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 40, 9, 61)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "paged+prefix": dict(),
    "paged": dict(enable_prefix_caching=False),
    "contiguous": dict(kv="contiguous"),
    "chunked": dict(max_num_batched_tokens=8, block_size=4),
    "preempting": dict(num_kv_blocks=14, block_size=8),
}


@pytest.fixture(scope="module")
def references(make_checkpoint):
    refs = {}
    for family in FAMILIES:
        path = make_checkpoint(family)
        loaded = load_model(path, dtype=torch.float32)
        prompts = _prompts(loaded.config.vocab_size)
        refs[family] = (loaded, prompts, _hf_greedy(path, prompts))
    return refs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
def test_batched_greedy_equals_transformers(references, family, mode):
    loaded, prompts, expected = references[family]
    llm = LLM(loaded=loaded, max_model_len=128, **MODES[mode])
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if mode == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.kv_stats()
    assert stats.blocks_used == 0


def test_staggered_arrivals_and_shared_prefixes(references):
    """Requests arrive at different steps, several share a long prefix (prefix-cache hits happen
    while earlier ones are still decoding), and every output still equals transformers'."""
    loaded, _, _ = references["qwen3"]
    rng = random.Random(7)
    shared = [rng.randrange(1000) for _ in range(37)]
    prompts = [shared + [rng.randrange(1000) for _ in range(k)] for k in (1, 5, 12, 0)] + [shared[:20]]
    expected = _hf_greedy(loaded.path, prompts)
    engine = build_engine(EngineArgs(max_model_len=128, block_size=4, max_num_batched_tokens=24), loaded)
    outputs: dict[str, list[int]] = {}
    step = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for delta in engine.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        step += 1
    assert [outputs[str(i)] for i in range(len(prompts))] == expected
    assert engine.kv.stats.hit_tokens > 0
    assert engine.kv_stats().blocks_used == 0


def test_fully_cached_prompt_still_generates(references):
    loaded, prompts, expected = references["llama"]
    llm = LLM(loaded=loaded, max_model_len=128, block_size=4)
    first = llm.generate([prompts[2]], GREEDY)[0]
    again = llm.generate([prompts[2]], GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[2]
    assert again.num_cached_tokens == (len(prompts[2]) - 1) // 4 * 4


def test_seeded_sampling_is_batch_invariant(references):
    loaded, prompts, _ = references["qwen2"]
    llm = LLM(loaded=loaded, max_model_len=128)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True) for _ in prompts]
    others[1] = seeded
    batched = llm.generate(prompts, others)[1].outputs[0].token_ids
    assert alone == batched
    different = llm.generate([prompts[1]], SamplingParams(temperature=0.9, max_tokens=16, seed=43,
                                                          ignore_eos=True))[0]
    assert different.outputs[0].token_ids != alone


def test_parallel_samples_share_the_prompt(references):
    loaded, prompts, expected = references["mistral"]
    llm = LLM(loaded=loaded, max_model_len=128, block_size=4)
    out = llm.generate([prompts[4]], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    # Siblings 2 and 3 reused sibling 1's prompt blocks instead of recomputing them.
    assert llm.engine.kv.stats.hit_tokens >= 2 * ((len(prompts[4]) - 1) // 4 * 4)
    greedy = llm.generate([prompts[4]], SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert [o.token_ids for o in greedy.outputs] == [expected[4], expected[4]]


def test_logprobs_match_transformers(references):
    import transformers

    loaded, prompts, _ = references["qwen3"]
    llm = LLM(loaded=loaded, max_model_len=128)
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    o = out.outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + o.token_ids])).logits[0, len(prompts[0]) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    assert o.logprobs is not None and o.top_logprobs is not None
    for i, tok in enumerate(o.token_ids):
        assert abs(o.logprobs[i] - ref[i, tok].item()) < 1e-4
        top_ids = [t for t, _ in o.top_logprobs[i]]
        assert top_ids == ref[i].topk(3).indices.tolist()


def test_stop_strings_and_stop_ids(demo_dir):
    llm = LLM(str(demo_dir), max_model_len=256)
    base = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    assert len(text) > 10
    stop = text[5:9]
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                            ignore_eos=True))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    by_id = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                              stop_token_ids=[ids[6]]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == ids[: ids.index(ids[6]) + 1]
    assert llm.engine.kv_stats().blocks_used == 0


def test_min_tokens_and_eos(demo_dir):
    llm = LLM(str(demo_dir), max_model_len=256)
    eos = llm.engine.stop_token_ids
    out = llm.generate(["hi"], SamplingParams(temperature=1.0, max_tokens=30, min_tokens=30, seed=0))[0].outputs[0]
    assert len(out.token_ids) == 30 and not set(out.token_ids) & eos


def test_abort_mid_prefill_frees_blocks(references):
    loaded, prompts, _ = references["llama"]
    engine = build_engine(EngineArgs(max_model_len=128, max_num_batched_tokens=8, block_size=4), loaded)
    engine.add_request("a", prompts[4], GREEDY)
    engine.add_request("b", prompts[1], GREEDY)
    engine.step()
    assert engine.kv_stats().blocks_used > 0
    assert engine.abort("a") and engine.abort("b") and not engine.abort("b")
    assert engine.kv_stats().blocks_used == 0 and not engine.has_unfinished()


def test_validation_errors(references):
    loaded, prompts, _ = references["llama"]
    engine = build_engine(EngineArgs(max_model_len=64), loaded)
    with pytest.raises(ValueError, match=r"64 tokens.*61 in the prompt \+ 32"):
        engine.add_request("x", prompts[4], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("y", [], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_a_draft_with_a_shorter_context_caps_max_model_len(demo_dir, tmp_path, caplog):
    """The builder caps max_model_len by the draft model's context as well as the target's: every
    sequence is drafted for up to its last token."""
    import json
    import shutil

    from nanoserve.model.demo import demo_draft_path

    draft = tmp_path / "short-draft"
    shutil.copytree(demo_draft_path(demo_dir.parent), draft)
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = 96
    (draft / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        engine = build_engine(EngineArgs(model=str(demo_dir), speculative_model=str(draft), max_model_len=512))
    assert engine.max_model_len == engine.limits.max_model_len == 96
    assert "the draft model's context" in caplog.text
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=93, ignore_eos=True))
    tokens = [t for _ in iter(engine.has_unfinished, False) for d in engine.step().deltas for t in d.token_ids]
    assert len(tokens) == 93 and engine.kv_stats().blocks_used == 0
    with pytest.raises(ValueError, match="maximum context length is 96"):
        engine.validate([5, 6, 7], SamplingParams(max_tokens=94))


def test_step_reports_each_finished_request_once(demo_dir):
    """`StepOutput.finished` names a request in the step of its last delta, once, after all its
    sequences ended; an aborted request is never reported."""
    engine = build_engine(EngineArgs(model=str(demo_dir), max_model_len=128))
    engine.add_request("n3", [1, 2, 3], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    engine.add_request("short", [4, 5], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.add_request("aborted", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    reported: list[str] = []
    ended: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished():
        out = engine.step()
        steps += 1
        if steps == 2:
            assert engine.abort("aborted")
        for d in out.deltas:
            ended[d.request_id] = ended.get(d.request_id, 0) + d.finished
        for rid in out.finished:
            assert ended[rid] == (3 if rid == "n3" else 1)  # its last sequence ended in this very step
        reported += out.finished
    assert sorted(reported) == ["n3", "short"]
