"""The decoder in one native call (`NativeDecoder`) against `CausalLM.forward` on the same C++ layer
ops and attention kernel: the same hidden states and the same K/V written, bit for bit, for every
family, both dtypes, decodes, drafts and prefill chunks mixed, one and two threads; what it refuses;
when it is built and which steps it takes; and that the engine's runners use it.

`CausalLM.forward` itself is checked against transformers in test_model_parity.py. The library is
built with the machine's g++ (CI machines have one); without a compiler these tests skip, and only
then, since the runner then has no native decoder."""

from __future__ import annotations

import shutil

import pytest
import torch

from nanoserve.attention import CpuPagedAttention, TorchAttention
from nanoserve.attention.cpu_paged import load_paged_attention
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm import build_engine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import load_model
from nanoserve.model.layer_ops import SMALL_M, CpuLayerOps, TorchLayerOps
from nanoserve.model.native_decoder import NativeDecoder
from nanoserve.native import load_cpu_kernels

from conftest import FAMILIES
from support import paged_batch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")

BLOCK_SIZE = 8
# (seq_len, query_len) per sequence, decodes first: fp32 steps of at most SMALL_M tokens (what
# fp32 sends here), and for bf16 also long prefill chunks (any size goes here in bf16).
FP32_SPECS = {"decodes": [(1, 1), (9, 1), (30, 1)], "decodes and drafts": [(12, 1), (30, 5), (17, 5), (40, 5)],
              "a short prefill after context": [(20, 1), (45, 15)]}
BF16_SPECS = {**FP32_SPECS, "long chunks": [(20, 1), (60, 25), (70, 70), (7, 3)]}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> tuple[CpuLayerOps, CpuPagedAttention]:
    cache = tmp_path_factory.mktemp("kernels")
    lib, kernel = load_cpu_kernels(cache), load_paged_attention(cache)
    assert lib is not None and kernel is not None, "g++ is installed, so the library must build"
    return CpuLayerOps(lib), CpuPagedAttention(kernel)


def _model(make_checkpoint, family: str, dtype: torch.dtype, ops: CpuLayerOps):
    # hidden 128 over 4 heads: head size 32, one the attention kernel is built for (the default test
    # shapes have 16 for three of the families).
    loaded = load_model(make_checkpoint(family, hidden_size=128), dtype=dtype)
    loaded.model.ops = ops
    # transformers initialises biases to zeros and norm weights to ones; random ones show a
    # bias or a norm weight that the native path dropped or took from the wrong layer.
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in loaded.model.parameters():
            if p.dim() == 1:
                p.add_((0.2 * torch.randn(p.shape, generator=g)).to(dtype))
    return loaded


def _step(cfg, specs, dtype, seed):
    """Random ids for the new tokens of `specs` and a pool of random K/V, so the earlier tokens of
    each sequence, and any padding slot that attention wrongly read, hold values."""
    num_blocks = sum(-(-s // BLOCK_SIZE) for s, _ in specs) + 4
    meta = paged_batch(specs, BLOCK_SIZE, num_blocks, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = meta.query_start_loc_cpu[-1]
    ids = torch.randint(cfg.vocab_size, (n,), generator=g)
    positions = torch.cat([torch.arange(s - q, s) for s, q in specs])
    kv = torch.randn(cfg.num_hidden_layers, 2, num_blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                     generator=g).to(dtype)
    return ids, positions, kv, meta


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_as_the_python_forward(make_checkpoint, kernels, family, dtype, threads):
    ops, backend = kernels
    loaded = _model(make_checkpoint, family, dtype, ops)
    native = NativeDecoder.build(loaded.model, backend)
    assert native is not None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, specs in enumerate((FP32_SPECS if dtype == torch.float32 else BF16_SPECS).values()):
            ids, positions, kv, meta = _step(loaded.config, specs, dtype, seed=i)
            assert native.fits(len(ids))
            kv_native = kv.clone()
            got = native(ids, positions, kv_native, meta)
            expected = loaded.model(ids, positions, kv, meta, backend)
            assert got.dtype == dtype and torch.equal(got, expected), specs
            assert torch.equal(kv_native, kv), specs
    finally:
        torch.set_num_threads(before)


def test_takes_what_runs_in_cpp_anyway(make_checkpoint, kernels):
    """fp32 steps of up to SMALL_M tokens (beyond, CpuLayerOps.linear hands fp32 to MKL); bf16 of any size."""
    ops, backend = kernels
    fp32 = NativeDecoder.build(_model(make_checkpoint, "qwen3", torch.float32, ops).model, backend)
    bf16 = NativeDecoder.build(_model(make_checkpoint, "qwen3", torch.bfloat16, ops).model, backend)
    assert fp32 is not None and bf16 is not None
    assert fp32.fits(SMALL_M) and not fp32.fits(SMALL_M + 1)
    assert bf16.fits(SMALL_M + 1) and bf16.fits(4096)


def test_built_only_on_the_cpp_path(make_checkpoint, kernels):
    ops, backend = kernels
    loaded = _model(make_checkpoint, "llama", torch.float32, ops)
    assert NativeDecoder.build(loaded.model, TorchAttention()) is None
    loaded.model.ops = TorchLayerOps()
    assert NativeDecoder.build(loaded.model, backend) is None
    small_heads = load_model(make_checkpoint("llama"), dtype=torch.float32)  # head size 16: no kernel build
    small_heads.model.ops = ops
    assert NativeDecoder.build(small_heads.model, backend) is None


def test_refuses_out_of_range_indices_having_written_nothing(make_checkpoint, kernels):
    ops, backend = kernels
    loaded = _model(make_checkpoint, "qwen2", torch.float32, ops)
    native = NativeDecoder.build(loaded.model, backend)
    assert native is not None
    ids, positions, kv, meta = _step(loaded.config, FP32_SPECS["decodes and drafts"], torch.float32, seed=5)
    pool = kv.clone()
    bad_ids = ids.clone()
    bad_ids[3] = loaded.config.vocab_size
    with pytest.raises(IndexError, match="token id"):
        native(bad_ids, positions, kv, meta)
    meta.slot_mapping[-1] = kv.shape[2] * BLOCK_SIZE
    with pytest.raises(IndexError, match="slot"):
        native(ids, positions, kv, meta)
    assert torch.equal(kv, pool)
    with pytest.raises(ValueError, match="int64"):
        native(ids.int(), positions, kv, meta)


def test_engine_runners_use_it(demo_dir, monkeypatch):
    """The demo target and its draft (here the target itself) run their steps through it on the CPU
    (fp32 decodes and verification steps of up to SMALL_M tokens), with the greedy output of the
    same engine without it."""
    calls = {"n": 0}
    call = NativeDecoder.__call__

    def counted(self, *args):
        calls["n"] += 1
        return call(self, *args)

    monkeypatch.setattr(NativeDecoder, "__call__", counted)
    args = EngineArgs(model=str(demo_dir), dtype="float32", speculative_model=str(demo_dir), num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate() -> list[int]:
        engine = build_engine(args)
        engine.add_request("r", list(range(10, 40)), params)
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for d in engine.step() for t in d.token_ids]
        return tokens

    engine = build_engine(args)
    assert engine.runner.native is not None and engine.proposer.runner.native is not None
    native = generate()
    assert calls["n"] > 24 // 4 * 2  # at least a verification and a draft pass per 4 tokens
    monkeypatch.setattr(NativeDecoder, "build", classmethod(lambda cls, model, backend: None))
    calls["n"] = 0
    assert generate() == native and calls["n"] == 0
