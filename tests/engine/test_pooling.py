"""Pooling requests in the engine: embeddings of tiny checkpoints against transformers' final hidden
states, alone and batched with generating requests in one step, chunked, preempted and from the
prefix cache, with every block freed after."""

from __future__ import annotations

import json
import random

import pytest
import torch

from nanoserve import LLM
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import PoolingParams, SamplingParams
from nanoserve.model import load_model
from nanoserve.runtime.builder import build_engine

from support.embeddings import cosine, hf_embeddings

PROMPT_LENGTHS = (3, 17, 40, 1, 29)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def model(make_checkpoint):
    path = make_checkpoint("qwen3")
    loaded = load_model(path, dtype=torch.float32)
    prompts = _prompts(loaded.config.vocab_size)
    return loaded, prompts, {m: hf_embeddings(path, prompts, m) for m in ("mean", "last")}


def pooling(method: str, dimensions: int | None = None) -> SamplingParams:
    return SamplingParams(pooling=PoolingParams(method, dimensions))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        scheduled: list[list[tuple[bool, int]]] | None = None) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Adds every request, steps to the end; the embeddings and the generated tokens by request id.
    `scheduled` collects each step's (is pooling, tokens) per scheduled sequence."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    embeddings: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    execute = engine.runner.execute

    def recording(plan):
        if scheduled is not None:
            scheduled.append([(s.params.pooling is not None, n) for s, n in plan.scheduled])
        return execute(plan)

    engine.runner.execute = recording  # type: ignore[method-assign]
    try:
        while engine.has_unfinished():
            for d in engine.step().deltas:
                if d.embedding is not None:
                    assert d.finished and not d.token_ids and d.request_id not in embeddings
                    embeddings[d.request_id] = d.embedding
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
    finally:
        del engine.runner.execute
    assert engine.kv_stats().blocks_used == 0
    assert not engine.runner.pooler._sums
    return embeddings, tokens


@pytest.mark.parametrize("method", ["mean", "last"])
@pytest.mark.parametrize("mode", [{}, {"max_num_batched_tokens": 8, "block_size": 4}])
def test_embeddings_equal_transformers(model, method, mode):
    loaded, prompts, refs = model
    engine = build_engine(EngineArgs(max_model_len=128, **mode), loaded)
    embeddings, tokens = run(engine, {str(i): (p, pooling(method)) for i, p in enumerate(prompts)})
    for i, ref in enumerate(refs[method]):
        assert cosine(embeddings[str(i)], ref) > 0.9999
        assert abs(torch.tensor(embeddings[str(i)]).norm().item() - 1) < 1e-5
    assert all(not t for t in tokens.values())
    assert engine.num_generated_tokens == 0


@pytest.mark.parametrize("method", ["mean", "last"])
def test_batched_with_generation_in_one_step(model, method):
    """Chunked pooling prompts share steps with decoding and prefilling requests: every vector is
    the one computed alone, and every generation the one generated alone."""
    loaded, prompts, refs = model
    args = EngineArgs(max_model_len=128, max_num_batched_tokens=16, block_size=4)
    alone_gen = run(build_engine(args, loaded), {"g0": (prompts[1], GREEDY), "g1": (prompts[4], GREEDY)})[1]
    engine = build_engine(args, loaded)
    requests = {"g0": (prompts[1], GREEDY), "g1": (prompts[4], GREEDY)}
    requests.update({f"e{i}": (p, pooling(method)) for i, p in enumerate(prompts)})
    steps: list[list[tuple[bool, int]]] = []
    embeddings, tokens = run(engine, requests, steps)
    assert any(any(p for p, _ in s) and any(not p for p, _ in s) for s in steps), "never pooled beside generation"
    assert any(any(p and n > 1 for p, n in s) and any(not p and n == 1 for p, n in s) for s in steps), \
        "never pooled beside a decode"
    for i, ref in enumerate(refs[method]):
        assert cosine(embeddings[f"e{i}"], ref) > 0.9999
    assert tokens["g0"] == alone_gen["g0"] and tokens["g1"] == alone_gen["g1"]


def test_last_token_pooling_reuses_the_prefix_cache(model):
    loaded, prompts, refs = model
    engine = build_engine(EngineArgs(max_model_len=128, block_size=4), loaded)
    first, _ = run(engine, {"a": (prompts[2], pooling("last"))})
    hits = engine.kv.stats.hit_tokens
    again, _ = run(engine, {"b": (prompts[2], pooling("last"))})
    assert engine.kv.stats.hit_tokens - hits == (len(prompts[2]) - 1) // 4 * 4
    assert cosine(again["b"], refs["last"][2]) > 0.9999
    assert torch.allclose(torch.tensor(first["a"]), torch.tensor(again["b"]), atol=1e-5)


def test_mean_pooling_computes_every_row(model):
    """A cached prefix would leave rows out of the mean: mean pooling skips the match."""
    loaded, prompts, refs = model
    engine = build_engine(EngineArgs(max_model_len=128, block_size=4), loaded)
    run(engine, {"g": (prompts[2], GREEDY)})  # caches the prompt's blocks
    hits = engine.kv.stats.hit_tokens
    embeddings, _ = run(engine, {"m": (prompts[2], pooling("mean"))})
    assert engine.kv.stats.hit_tokens == hits
    assert cosine(embeddings["m"], refs["mean"][2]) > 0.9999


def test_preempted_mean_pooling_starts_its_sum_again(model):
    loaded, prompts, refs = model
    engine = build_engine(EngineArgs(max_model_len=128, block_size=4, num_kv_blocks=14, max_num_batched_tokens=8),
                          loaded)
    requests = {"g": (prompts[4], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
                "m": (prompts[2], pooling("mean"))}
    embeddings, _ = run(engine, requests)
    assert engine.num_preemptions > 0
    assert cosine(embeddings["m"], refs["mean"][2]) > 0.9999


def test_dimensions_cut_then_normalize(model, make_checkpoint):
    """`is_matryoshka` in config.json allows any size; the same seed gives the same weights."""
    _, prompts, refs = model
    loaded = load_model(make_checkpoint("qwen3", is_matryoshka=True), dtype=torch.float32)
    assert loaded.model.embed_tokens.weight.equal(model[0].model.embed_tokens.weight)
    engine = build_engine(EngineArgs(max_model_len=128), loaded)
    embeddings, _ = run(engine, {"d": (prompts[1], pooling("last", 16))})
    expected = torch.nn.functional.normalize(refs["last"][1][:16], dim=0)
    assert len(embeddings["d"]) == 16 and cosine(embeddings["d"], expected) > 0.9999


def test_pooling_validation(model):
    loaded, prompts, _ = model
    engine = build_engine(EngineArgs(max_model_len=32), loaded)
    with pytest.raises(ValueError, match="Matryoshka"):
        engine.add_request("x", prompts[0], pooling("mean", 8))
    with pytest.raises(ValueError, match="maximum context length is 32 tokens; the request asks for 40 in the input"):
        engine.add_request("y", prompts[2], pooling("mean"))
    with pytest.raises(ValueError, match="n = 1"):
        SamplingParams(n=2, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling method"):
        PoolingParams("cls")


def test_offline_embed(model):
    """`LLM.embed` pools as the checkpoint declares (mean: it declares nothing)."""
    loaded, prompts, refs = model
    llm = LLM(loaded=loaded, max_model_len=128, max_num_batched_tokens=16)
    vectors = llm.embed(prompts)
    assert all(cosine(v, ref) > 0.9999 for v, ref in zip(vectors, refs["mean"], strict=True))
    (alone,) = llm.embed(prompts[1])  # other chunks, other kernels: equal to rounding
    assert torch.allclose(torch.tensor(alone), torch.tensor(vectors[1]), atol=1e-5)
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(prompts, dimensions=8)
    assert llm.engine.kv_stats().blocks_used == 0


def test_no_drafts_for_a_pooling_prompt_one_token_short(model):
    """A repetitive prompt cut 8 + 8 + 1: before its last chunk it looks like a decode that the
    n-gram proposer could draft for; a pooling sequence gets none, and its vector stays exact."""
    loaded, _, _ = model
    prompt = [5, 6, 7] * 5 + [5, 6]
    (ref,) = hf_embeddings(loaded.path, [prompt], "last")
    engine = build_engine(EngineArgs(max_model_len=128, max_num_batched_tokens=8, block_size=4,
                                     speculative_method="ngram", num_speculative_tokens=3), loaded)
    embeddings, tokens = run(engine, {"e": (prompt, pooling("last")), "g": (prompt, GREEDY)})
    assert cosine(embeddings["e"], ref) > 0.9999 and len(tokens["g"]) == GREEDY.max_tokens


def test_pooling_declarations(tmp_path):
    from nanoserve.model.checkpoint.pooling import PoolingConfig, read_pooling_config

    def declare(name: str, modes: dict[str, bool], config: dict | None = None):
        folder = tmp_path / name
        (folder / "1_Pooling").mkdir(parents=True)
        (folder / "modules.json").write_text(json.dumps(
            [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
        (folder / "config.json").write_text(json.dumps(config or {}))
        return folder

    assert read_pooling_config(tmp_path / "model.gguf", 64) == PoolingConfig("mean", 64)
    last = read_pooling_config(declare("last", {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False},
                                       {"matryoshka_dimensions": [16, 32]}), 64)
    assert last == PoolingConfig("last", 64, True, (16, 32))
    last.check_dimensions(32)
    with pytest.raises(ValueError, match=r"one of \[16, 32\]"):
        last.check_dimensions(8)
    assert read_pooling_config(declare("mean", {"pooling_mode_mean_tokens": True}), 64).method == "mean"
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        read_pooling_config(declare("cls", {"pooling_mode_cls_token": True}), 64)
    anything = read_pooling_config(declare("any", {}, {"is_matryoshka": True}), 64)
    anything.check_dimensions(64)
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        anything.check_dimensions(65)
