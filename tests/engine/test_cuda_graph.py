"""CUDA-graph decode batches and GPU memory sizing, checked on the CPU.

Off CUDA, `DecodeGraphs` runs the captured computation eagerly on its static, padded buffers, with
the fixed-split Triton backend a graph would use. Under the Triton interpreter that checks everything
but the capture itself: padding up the ladder of sizes, resetting padding rows after larger batches,
slot -1 and seq_len 0 rows, and the copy into the wide block-table buffer. As in
test_triton_attention.py, the interpreted cases run in a subprocess started with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention import AttentionMetadata, TorchAttention, TritonAttention
from nanoserve.commands.common import add_engine_args, engine_args_from
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.cuda_graph import MAX_CAPTURE_SIZE, DecodeGraphs, capture_sizes, decode_splits
from nanoserve.engine.memory_profile import kv_budget_bytes, scratch_prefill
from nanoserve.engine.model_protocol import KVShape
from nanoserve.model import load_model

pytestmark = pytest.mark.gpu

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="already interpreted, or no triton")
@pytest.mark.slow
def test_graph_cases_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-k",
           "interpreted_"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


@pytest.mark.parametrize("top", [1, 2, 3, 5, 8, 9, 64, 100, 256, 1000])
def test_capture_sizes_ladder(top: int) -> None:
    sizes = capture_sizes(top)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(top, MAX_CAPTURE_SIZE)
    for n in range(1, sizes[-1] + 1):  # every batch pads by at most 7 rows
        assert next(s for s in sizes if s >= n) - n <= 7
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_decode_splits() -> None:
    assert decode_splits(1, 8, num_sms=132) == 16  # capped: 264 programs would need 33 splits
    assert decode_splits(16, 8, num_sms=132) == 3  # 128 x 3 programs >= 2 waves of 132
    assert decode_splits(256, 8, num_sms=132) == 1


def test_kv_budget_bytes() -> None:
    gib = 1 << 30
    # 0.9 of 80 GiB = 72; 20 in use (weights, context), 2 of activations -> 50 for KV.
    assert kv_budget_bytes(80 * gib, 60 * gib, 2 * gib, 0.9) == 50 * gib
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        kv_budget_bytes(80 * gib, 10 * gib, 2 * gib, 0.9)


def test_resolve_num_blocks_from_free_memory() -> None:
    args = EngineArgs(max_model_len=1024, max_num_seqs=4, block_size=16)
    assert args.resolve_num_blocks(1000, free_memory=50_000) == 50
    assert args.resolve_num_blocks(1000, free_memory=10**9) == 4 * 64  # never more than the sequences need
    assert EngineArgs(max_model_len=1024, kv_cache_memory=9000).resolve_num_blocks(1000, free_memory=10**9) == 9
    with pytest.raises(ValueError, match="smaller than one KV block"):
        args.resolve_num_blocks(1000, free_memory=999)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_cli_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--enforce-eager", "--gpu-memory-utilization", "0.5"]))
    assert args.enforce_eager and args.gpu_memory_utilization == 0.5


def test_scratch_prefill_isolates_sequences(make_checkpoint) -> None:
    """50 tokens with max_model_len 20 -> sequences of 20, 20 and 10 identical tokens: each attends
    only to its own, so equal positions give equal hidden states."""
    loaded = load_model(make_checkpoint("qwen3"), dtype=torch.float32)
    cfg = loaded.config
    shape = KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    hidden = scratch_prefill(loaded.model, shape, 50, 20, 16, TorchAttention(), torch.device("cpu"))
    assert hidden.shape == (50, cfg.hidden_size)
    torch.testing.assert_close(hidden[:20], hidden[20:40], atol=0, rtol=0)
    torch.testing.assert_close(hidden[:10], hidden[40:], atol=1e-5, rtol=0)  # shorter: other SDPA tiling
    assert not torch.equal(hidden[0], hidden[5])


@interpreted
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interpreted_decode_graphs_match_eager(make_checkpoint, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """Greedy decoding with decode steps through the padded graph buffers (Triton, fixed splits)
    equals the torch backend's eager output, as the batch shrinks 3 -> 2 -> 1 (padded to 4, 2, 1)
    and a second, smaller batch reuses buffers left dirty by the first."""
    path = make_checkpoint(family)
    loaded = load_model(path, dtype=torch.float32)
    prompts = [[5, 17, 200, 31, 9, 44, 12], list(range(40, 61)), [7, 7, 300, 2]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 7, 3)]
    common = dict(loaded=loaded, max_model_len=64, block_size=4)
    ref = [o.outputs[0].token_ids for o in LLM(attention_backend="torch", **common).generate(prompts, params)]
    assert sorted(map(len, ref)) == [3, 7, 12]

    llm = LLM(attention_backend="triton", **common)
    llm.engine.runner.use_decode_graphs(loaded.config.num_key_value_heads, max_batch_size=8, max_model_len=64)
    graphs = llm.engine.runner.decode_graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.sizes == [1, 2, 4, 8]
    sizes_run: list[int] = []
    original = DecodeGraphs.run

    def spy(self: DecodeGraphs, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        sizes_run.append(meta.num_seqs)
        return original(self, input_ids, positions, meta)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref
    assert {3, 2, 1} <= set(sizes_run)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[1:2], params[1:2])]
    assert again == ref[1:2]
    assert llm.engine.kv_stats().blocks_used == 0


@interpreted
def test_interpreted_padding_rows_never_write_kv(make_checkpoint) -> None:
    """After a batch of 4, a batch of 3 runs padded to 4: row 3 still holds the old sequence's
    token and slot, which must be reset to padding, not written again into a block that may now be
    someone else's. Its logits rows equal an unpadded eager step's."""
    loaded = load_model(make_checkpoint("qwen3"), dtype=torch.float32)
    cfg = loaded.config
    kv = torch.zeros(cfg.num_hidden_layers, 2, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
    graphs = DecodeGraphs(loaded.model, kv, cfg.num_key_value_heads, max_batch_size=4, max_model_len=16, block_size=4)

    def decode_meta(n: int) -> AttentionMetadata:  # n one-token sequences, sequence s in block s
        return AttentionMetadata.build(slot_mapping=[4 * s for s in range(n)], block_tables=[[s] for s in range(n)],
                                       query_start_loc=range(n + 1), seq_lens=[1] * n, num_decodes=n, block_size=4)

    ids = torch.tensor([11, 22, 33, 44])
    graphs.run(ids, torch.zeros(4, dtype=torch.long), decode_meta(4))
    assert kv[:, :, 3, 0].abs().sum() > 0
    kv[:, :, 3].fill_(7.0)  # block 3 now belongs to someone else
    logits = graphs.run(ids[:3], torch.zeros(3, dtype=torch.long), decode_meta(3))
    assert bool((kv[:, :, 3] == 7.0).all())
    hidden = loaded.model(ids[:3], torch.zeros(3, dtype=torch.long), kv.clone(), decode_meta(3), TritonAttention())
    torch.testing.assert_close(logits, loaded.model.compute_logits(hidden), atol=1e-5, rtol=0)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_matches_cpu(make_checkpoint) -> None:
    """`device="cuda"` end to end, KV pool sized from GPU memory, decode through captured graphs
    (and with enforce_eager, without): fp32 greedy output equals the CPU engine's."""
    path = str(make_checkpoint("qwen3"))
    prompts = [[5, 17, 200, 31, 9, 44, 12], list(range(40, 61)), [7, 7, 300, 2]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 7, 3)]
    common = dict(dtype="float32", max_model_len=64, max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in LLM(path, **common).generate(prompts, params)]
    for eager in (False, True):
        llm = LLM(path, device="cuda", enforce_eager=eager, **common)
        assert (llm.engine.runner.decode_graphs is None) == eager
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.kv_stats().blocks_used == 0


@interpreted
def test_interpreted_draft_passes_through_graphs(make_checkpoint) -> None:
    """Speculative decoding with the draft's single-token passes and the target's plain decode steps
    through padded graph buffers keeps greedy output exact (the target is its own draft here)."""
    path = str(make_checkpoint("qwen3"))
    prompts = [[5, 17, 200, 31, 9, 44, 12], list(range(40, 61)), [7, 7, 300, 2]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 7, 5)]
    common = dict(dtype="float32", max_model_len=64, block_size=4)
    ref = [o.outputs[0].token_ids for o in LLM(path, attention_backend="torch", **common).generate(prompts, params)]
    llm = LLM(path, attention_backend="triton", speculative_model=path, num_speculative_tokens=3, **common)
    heads = llm.engine.runner.kv_cache.shape[-2]
    llm.engine.runner.use_decode_graphs(heads, max_batch_size=4, max_model_len=64)
    llm.engine.proposer.runner.use_decode_graphs(heads, max_batch_size=4, max_model_len=64)  # type: ignore[union-attr]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert llm.engine.spec_stats.accepted > 0 and llm.engine.kv_stats().blocks_used == 0
