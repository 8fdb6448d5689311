"""Tensor parallelism on the CPU (gloo, fp32): TP=2 greedy output equal to TP=1, through the engine
(prefix cache hits, chunked prefill, preemption by a small KV pool, speculative decoding) and
through a real server under concurrent requests; a killed worker rank fails requests cleanly."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.model import load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.parallel.group import free_port
from nanoserve.parallel.megatron import shard_config
from nanoserve.parallel.runner import TensorParallelRunner
from nanoserve.parallel.worker import run_node_workers
from nanoserve.runtime.builder import build_engine

from support.families import FAMILIES
from support.server import SERVED, serve

pytestmark = pytest.mark.slow

# A pool of 24 blocks of 4 tokens holds about two of these sequences at once (preemption), prefill
# chunks of at most 16 tokens, and prompts that share a 12-token prefix (prefix cache hits).
ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
                              num_kv_blocks=24, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _checkpoint(make_checkpoint: Callable[..., Path], family: str) -> Path:
    """The family's tiny checkpoint, with KV heads that split in two (the conftest's Mistral has one)."""
    return make_checkpoint(family, num_key_value_heads=2) if family == "mistral" else make_checkpoint(family)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(12)]
    return [shared + [rng.randrange(vocab) for _ in range(n)] for n in (5, 20, 31)] + [[rng.randrange(vocab)] * 3]


def _greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _live_workers() -> list[int]:
    """The pids of this process's children that run a worker rank and have not exited."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(ppid) == os.getpid() and state != "Z" and b"nanoserve.parallel" in command:
            pids.append(int(stat.parent.name))
    return pids


def test_shard_config_needs_heads_that_divide(make_checkpoint: Callable[..., Path]) -> None:
    cfg = load_model(make_checkpoint("mistral"), dtype="float32").config  # 4 query heads, 1 KV head
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        shard_config(cfg, 2)
    llama = load_model(make_checkpoint("llama"), dtype="float32").config  # 4 query heads, 2 KV heads
    half = shard_config(llama, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size) == (2, 1, 64)
    assert half.vocab_size == -(-llama.vocab_size // 2)


def test_a_model_that_does_not_split_fails_the_build(make_checkpoint: Callable[..., Path]) -> None:
    """Every rank refuses a model with one KV head, and no worker is left running."""
    with pytest.raises(ValueError, match="must divide num_key_value_heads=1"):
        build_engine(EngineArgs(model=str(make_checkpoint("mistral")), dtype="float32", tensor_parallel_size=2))
    assert not _live_workers()


def test_quantized_weights_are_refused_at_tensor_parallel(make_checkpoint: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    """--quantization with several ranks is an argument error; a quantized GGUF fails the build
    naming the format, and no worker is left running."""
    with pytest.raises(ValueError, match="quantization must be 'none' with tensor_parallel_size > 1"):
        EngineArgs(model="m", quantization="int8", tensor_parallel_size=2)
    gguf_path = export_gguf(make_checkpoint("llama"), tmp_path / "llama-q8_0.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"tensor parallelism shards dense weights; .* is 'q8_0'"):
        build_engine(EngineArgs(model=str(gguf_path), dtype="float32", tensor_parallel_size=2))
    assert not _live_workers()


def test_a_build_that_fails_on_rank_0_leaves_no_worker(make_checkpoint: Callable[..., Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("nanoserve.runtime.builder.load_model", fail)
    with pytest.raises(OSError, match="disk gone"):
        build_engine(EngineArgs(model=str(make_checkpoint("llama")), dtype="float32", tensor_parallel_size=2))
    gc.collect()
    assert not _live_workers()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_equals_tp1(make_checkpoint: Callable[..., Path], family: str) -> None:
    path = str(_checkpoint(make_checkpoint, family))
    reference = LLM(path, **ENGINE)
    prompts = _prompts(reference.engine.vocab_size)
    expected = _greedy(reference, prompts)
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert isinstance(llm.engine.runner, TensorParallelRunner)
        assert _greedy(llm, prompts) == expected
        assert llm.engine.num_preemptions > 0
        again = llm.generate(prompts, GREEDY)  # the prompts' blocks now come from the prefix cache
        assert [list(o.outputs[0].token_ids) for o in again] == expected
        assert all(o.num_cached_tokens > 0 for o in again[:3])
        assert _live_workers()
    finally:
        llm.engine.close()
    assert not _live_workers()


def test_tp2_embeddings_equal_tp1(make_checkpoint: Callable[..., Path]) -> None:
    """Pooling rows come from rank 0's hidden states, which the group's forward completes."""
    path = str(_checkpoint(make_checkpoint, "qwen3"))
    reference = LLM(path, **ENGINE)
    prompts = _prompts(reference.engine.vocab_size)
    expected = torch.tensor(reference.embed(prompts))
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    try:
        assert torch.allclose(torch.tensor(llm.embed(prompts)), expected, atol=1e-4)
        assert llm.engine.kv_stats().blocks_used == 0
    finally:
        llm.engine.close()


def test_tp2_speculative_decoding_keeps_greedy_output(make_checkpoint: Callable[..., Path]) -> None:
    """n-gram drafts verified by the sharded model, and a draft model run whole on rank 0 (the
    target itself as its own draft: every draft is accepted)."""
    path = str(_checkpoint(make_checkpoint, "qwen3"))
    rng = random.Random(3)
    motif = [rng.randrange(500) for _ in range(6)]
    prompts = [motif * 4, [rng.randrange(500) for _ in range(9)]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _greedy(LLM(path, dtype="float32", max_model_len=128), prompts, params)
    for spec in ({"speculative_method": "ngram"}, {"speculative_model": path, "speculative_dtype": "float32"}):
        llm = LLM(path, dtype="float32", max_model_len=128, tensor_parallel_size=2, **spec)
        try:
            assert _greedy(llm, prompts, params) == expected
            assert llm.engine.spec_stats.accepted > 0
        finally:
            llm.engine.close()


def test_two_nodes_on_one_machine(make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """--nnodes 2: node 1 runs only its worker rank (as `nanoserve serve --node-rank 1` does), node 0
    the engine; they meet at MASTER_ADDR:MASTER_PORT and give TP=1's output; the engine's stop
    ends node 1's worker cleanly."""
    path = str(_checkpoint(make_checkpoint, "qwen2"))
    reference = LLM(path, **ENGINE)
    prompts = _prompts(reference.engine.vocab_size)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    node1: list[int] = []
    args = EngineArgs(model=path, tensor_parallel_size=2, nnodes=2, node_rank=1, **ENGINE)
    thread = threading.Thread(target=lambda: node1.append(run_node_workers(args)))
    thread.start()
    llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, **ENGINE)
    try:
        assert isinstance(llm.engine.runner, TensorParallelRunner) and not llm.engine.runner.workers.processes
        assert _greedy(llm, prompts) == _greedy(reference, prompts)
    finally:
        llm.engine.close()
    thread.join(timeout=30)
    assert node1 == [0]


def _complete(url: str, prompt: list[int], max_tokens: int = 16) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True})


def test_server_under_load_then_a_dead_rank(make_checkpoint: Callable[..., Path]) -> None:
    """Concurrent requests through a TP=2 server give TP=1's text; then a worker is killed in the
    middle of a long request: that request fails with an OpenAI-shaped error, /health answers 503
    naming the rank, later requests are refused, and the server itself stays up."""
    path = str(_checkpoint(make_checkpoint, "llama"))
    reference = LLM(path, dtype="float32", max_model_len=256)
    prompts = _prompts(reference.engine.vocab_size)
    expected = [o.outputs[0].text for o in reference.generate(prompts, GREEDY)]
    engines: list[LLMEngine] = []

    def loader() -> LLMEngine:
        engines.append(build_engine(EngineArgs(model=path, dtype="float32", max_model_len=256,
                                               tensor_parallel_size=2)))
        return engines[0]

    with serve(loader) as (url, _):
        texts: dict[int, str] = {}

        def ask(i: int) -> None:
            texts[i] = _complete(url, prompts[i]).json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [texts[i] for i in range(len(prompts))] == expected

        runner = engines[0].runner
        assert isinstance(runner, TensorParallelRunner)
        long: list[httpx.Response] = []
        request = threading.Thread(target=lambda: long.append(_complete(url, prompts[0], max_tokens=200)))
        request.start()
        while not engines[0].num_running_seqs:
            time.sleep(0.01)
        runner.workers.processes[1].kill()
        request.join(timeout=30)
        assert not request.is_alive()
        assert long[0].status_code == 503 and "tensor-parallel rank 1 died" in long[0].json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "rank 1 died" in health.json()["error"]["message"]
        assert _complete(url, prompts[1]).status_code == 503
        assert httpx.get(f"{url}/v1/models").status_code == 200
