"""The decoder in one native call (`NativeDecoder`) against `CausalLM.forward` on the same C++ layer
ops and attention kernel: the same hidden states and the same K/V written, bit for bit, for every
family, both dtypes, decodes, drafts and prefill chunks mixed, one and two threads; what it refuses
(out-of-range indices, and weights in a format it cannot read: the weight-format seam, checked with a
second, int8 format defined here, which the loader fills and every product refuses by name); when it
is built and which steps it takes; and that the engine's runners use it.

`CausalLM.forward` itself is checked against transformers in test_model_parity.py. The library is
built with the machine's g++ (CI machines have one); without a compiler these tests skip, and only
then, since the runner then has no native decoder."""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from typing import cast

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.attention import CpuPagedAttention, TorchAttention
from nanoserve.attention.cpu_paged import load_paged_attention
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import families, load_model
from nanoserve.model.checkpoint.loader import iter_safetensors, safetensors_files
from nanoserve.model.checkpoint.weights import load_weights
from nanoserve.model.config import ModelConfig
from nanoserve.model.decoder import CausalLM
from nanoserve.model.demo import demo_draft_path
from nanoserve.model.layer_ops import CpuLayerOps, TorchLayerOps
from nanoserve.model.native_decoder import NativeDecoder
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, StackedWeight
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight, UnsupportedWeightFormat
from nanoserve.native import load_cpu_kernels
from nanoserve.runtime.builder import build_engine

from support.families import FAMILIES
from support.forward import paged_batch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")

BLOCK_SIZE = 8
# (seq_len, query_len) per sequence, decodes first: decodes, drafts, and prefill chunks short and long.
SPECS = {"decodes": [(1, 1), (9, 1), (30, 1)], "decodes and drafts": [(12, 1), (30, 5), (17, 5), (40, 5)],
         "a short prefill after context": [(20, 1), (45, 15)], "long chunks": [(20, 1), (60, 25), (70, 70), (7, 3)]}


@pytest.fixture(scope="module")
def kernels() -> tuple[CpuLayerOps, CpuPagedAttention]:
    lib, kernel = load_cpu_kernels(), load_paged_attention()
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
        for i, specs in enumerate(SPECS.values()):
            ids, positions, kv, meta = _step(loaded.config, specs, dtype, seed=i)
            kv_native = kv.clone()
            got = native(ids, positions, kv_native, meta)
            expected = loaded.model(ids, positions, kv, meta, backend)
            assert got.dtype == dtype and torch.equal(got, expected), specs
            assert torch.equal(kv_native, kv), specs
    finally:
        torch.set_num_threads(before)


def _random_blocks(fmt: str, rows: int, in_features: int, dtype: torch.dtype, g: torch.Generator) -> BlockQuantWeight:
    """A weight of random valid blocks: random bytes, fp16 scales in +-[1e-4, 5e-4]."""
    w = BlockQuantWeight.empty(fmt, rows, in_features, dtype)
    w.blocks.copy_(torch.randint(0, 256, w.blocks.shape, generator=g, dtype=torch.uint8))
    blocks = w.blocks.view(-1, BLOCK_FORMATS[fmt].type_size)
    for at in {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}.get(fmt, (0,)):
        scales = (torch.rand(blocks.shape[0], generator=g) * 4e-4 + 1e-4) * (torch.randint(0, 2, (blocks.shape[0],),
                                                                                            generator=g) * 2 - 1)
        blocks[:, at:at + 2] = scales.to(torch.float16).view(torch.uint8).view(-1, 2)
    return w


def _quantized(dense: LinearWeight, fmt: str, dtype: torch.dtype, g: torch.Generator) -> LinearWeight:
    """`dense` in `fmt`: its values quantized (q8_0, q4_0), random blocks (k-quants), or as it is."""
    if fmt == "dense":
        return dense
    if fmt in ("q8_0", "q4_0"):
        w = BlockQuantWeight.empty(fmt, *dense.shape, dtype)
        w.copy_(cast(DenseWeight, dense).weight)
        return w
    return _random_blocks(fmt, *dense.shape, dtype, g)


def _quantize_model(model: CausalLM, dtype: torch.dtype) -> None:
    """Every matrix of `model` block-quantized or stacked from parts in different formats (as Q4_K_M
    files are: v in q6_k), layer by layer differently, a dense part among them; the embedding table
    q8_0, an untied LM head q6_k."""
    g = torch.Generator().manual_seed(3)
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k = attn.q_size, attn.kv_size
        qkv = cast(DenseWeight, attn.qkv_proj).weight
        parts = (("q4_k", "q5_k", "q6_k"), ("dense", "q8_0", "q4_0"))[i % 2]
        attn.qkv_proj = StackedWeight([_quantized(DenseWeight(qkv[lo:hi]), fmt, dtype, g)
                                       for (lo, hi), fmt in zip(((0, q), (q, q + k), (q + k, q + 2 * k)), parts,
                                                                strict=True)])
        attn.o_proj = _quantized(attn.o_proj, "q4_k" if attn.o_proj.in_features % 256 == 0 else "q4_0", dtype, g)
        gate_up = cast(DenseWeight, mlp.gate_up_proj).weight
        inter = gate_up.shape[0] // 2
        mlp.gate_up_proj = StackedWeight([_quantized(DenseWeight(gate_up[:inter]), ("q4_k", "q8_0")[i % 2], dtype, g),
                                          _quantized(DenseWeight(gate_up[inter:]), ("q5_k", "q4_0")[i % 2], dtype, g)])
        mlp.down_proj = _quantized(mlp.down_proj, ("q6_k", "q8_0")[i % 2], dtype, g)
    model.embed_tokens = _quantized(model.embed_tokens, "q8_0", dtype, g)
    if model.lm_head is not None:
        model.lm_head = _quantized(model.lm_head, "q6_k", dtype, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_as_the_python_forward_with_quantized_weights(make_checkpoint, kernels, family, dtype):
    """Block-quantized and stacked matrices, a quantized embedding table and LM head: the same
    hidden states, K/V and first greedy drafts (the head's product and argmax) as the Python path."""
    ops, backend = kernels
    loaded = load_model(make_checkpoint(family, hidden_size=256, intermediate_size=512), dtype=dtype)
    loaded.model.ops = ops
    _quantize_model(loaded.model, dtype)
    native = NativeDecoder.build(loaded.model, backend)
    assert native is not None
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for i, specs in enumerate(SPECS.values()):
                ids, positions, kv, meta = _step(loaded.config, specs, dtype, seed=i)
                kv_native = kv.clone()
                got = native(ids, positions, kv_native, meta)
                expected = loaded.model(ids, positions, kv, meta, backend)
                assert got.dtype == dtype and torch.equal(got, expected), specs
                assert torch.equal(kv_native, kv), specs
                assert got.abs().max() > 0 and got.isfinite().all()
                drafts = native.draft_greedy(ids, positions, kv.clone(), meta, [1] * meta.num_seqs, 0.0,
                                             loaded.config.vocab_size)
                last = expected[torch.tensor(meta.query_start_loc_cpu[1:]) - 1]
                assert drafts == [[t] for t in loaded.model.compute_logits(last).argmax(dim=-1).tolist()], specs
        finally:
            torch.set_num_threads(before)


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
    ids, positions, kv, meta = _step(loaded.config, SPECS["decodes and drafts"], torch.float32, seed=5)
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


class Int8RowWeight(LinearWeight):
    """A second weight format: int8 values with one fp32 scale per row (symmetric, scale = the row's
    largest magnitude / 127). No products exist for it, so every one must refuse it by name."""

    format = "int8_rowwise"

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__(out_features, in_features)
        self.register_buffer("values", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.zeros(out_features))

    def __getitem__(self, rows: slice) -> _Int8Rows:
        return _Int8Rows(self, rows)

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


class _Int8Rows:
    """A slice of an Int8RowWeight's rows, as a loader destination: quantizes what it is given."""

    def __init__(self, weight: Int8RowWeight, rows: slice) -> None:
        self.weight, self.rows = weight, rows
        self.shape = weight.values[rows].shape

    def copy_(self, src: torch.Tensor) -> None:
        src = src.float()
        scale = src.abs().amax(dim=1).clamp_min(1e-30) / 127
        self.weight.values[self.rows] = torch.round(src / scale[:, None]).to(torch.int8)
        self.weight.scales[self.rows] = scale


def test_the_loader_fills_a_weight_of_another_format(make_checkpoint):
    """load_weights writes into any LinearWeight through its row-slice destinations: a whole matrix
    (o_proj) and the fused gate/up (two row slices), quantized, the rest as before."""
    path = make_checkpoint("qwen2")
    model = CausalLM(ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text())), torch.float32)
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    attn.o_proj = Int8RowWeight(*attn.o_proj.shape)
    mlp.gate_up_proj = Int8RowWeight(*mlp.gate_up_proj.shape)
    load_weights(model, iter_safetensors(safetensors_files(path)), families.FAMILIES[model.cfg.family])
    ckpt = load_file(path / "model.safetensors")
    prefix = "model.layers.1."
    expected = {"o": ckpt[prefix + "self_attn.o_proj.weight"],
                "gate_up": torch.cat([ckpt[prefix + "mlp.gate_proj.weight"], ckpt[prefix + "mlp.up_proj.weight"]])}
    for key, w in (("o", attn.o_proj), ("gate_up", mlp.gate_up_proj)):
        assert isinstance(w, Int8RowWeight) and w.scales.min() > 0
        error = (w.dequantize() - expected[key]).abs()
        assert (error <= w.scales[:, None] / 2 + 1e-7).all()  # within half a step of each row's grid
    assert torch.equal(model.layers[1].mlp.down_proj.weight, ckpt[prefix + "mlp.down_proj.weight"])


def test_refuses_a_weight_format_it_cannot_read(make_checkpoint, kernels, caplog):
    """A model with one matrix in another format: `build` declines it (the runner then takes the
    Python forward) and logs which; the constructor raises naming the layer and format; and both
    LayerOps refuse the product by the format's name instead of reading its bytes as a matrix."""
    ops, backend = kernels
    model = _model(make_checkpoint, "qwen3", torch.float32, ops).model
    assert NativeDecoder.build(model, backend) is not None
    mlp = model.layers[1].mlp
    quantized = Int8RowWeight(*mlp.down_proj.shape)
    quantized.copy_(mlp.down_proj.weight)
    mlp.down_proj = quantized
    with caplog.at_level(logging.INFO, logger="nanoserve.model.native_decoder"):
        assert NativeDecoder.build(model, backend) is None
    assert "layers.1.mlp.down_proj in format 'int8_rowwise'" in caplog.text
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj in format 'int8_rowwise'"):
        NativeDecoder(model, ops)
    x = torch.randn(2, mlp.down_proj.in_features)
    for layer_ops in (ops, TorchLayerOps()):
        with pytest.raises(UnsupportedWeightFormat, match="int8_rowwise"):
            layer_ops.linear(x, quantized)


@pytest.mark.slow
def test_engine_runners_use_it(demo_dir, monkeypatch):
    """The demo target and its draft (here the target itself) run their steps through it on the CPU
    (every step, prefill chunks too; every draft pass of a proposal in
    one `draft_greedy` call), with the greedy output of the same engine without it."""
    calls: Counter[str] = Counter()
    call, draft = NativeDecoder.__call__, NativeDecoder.draft_greedy

    def counted_call(self, *args):
        calls["forward"] += 1
        return call(self, *args)

    def counted_draft(self, *args):
        calls["draft"] += 1
        return draft(self, *args)

    monkeypatch.setattr(NativeDecoder, "__call__", counted_call)
    monkeypatch.setattr(NativeDecoder, "draft_greedy", counted_draft)
    args = EngineArgs(model=str(demo_dir), dtype="float32", speculative_model=str(demo_dir), num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def generate() -> list[int]:
        engine = build_engine(args)
        engine.add_request("r", list(range(10, 40)), params)
        tokens: list[int] = []
        while engine.has_unfinished():
            tokens += [t for d in engine.step().deltas for t in d.token_ids]
        return tokens

    engine = build_engine(args)
    assert engine.runner.native is not None and engine.proposer.runner.native is not None
    native = generate()
    assert calls["forward"] > 24 // 4 and calls["draft"] > 24 // 4  # a verification and a proposal per 4 tokens
    monkeypatch.setattr(NativeDecoder, "build", classmethod(lambda cls, model, backend: None))
    calls.clear()
    assert generate() == native and not calls


Proposals = list[list[tuple[str, int, list[int]]]]  # per proposal: (request id, budget, drafts) per sequence
QUESTIONS = ("What is the capital of France?", "Count from one to ten.", "Tell me a short story about a cat.")
GREEDY = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 25, 33)]


def _speculate(args: EngineArgs, native: bool) -> tuple[Proposals, dict[str, list[int]], torch.Tensor]:
    """Greedy generations of three chat prompts at once with speculation: every proposal, the
    outputs and the draft model's KV pool afterwards; `native=False` drafts pass by pass."""
    engine = build_engine(args)
    runner, propose = engine.proposer.runner, engine.proposer.propose
    assert runner.native is not None
    if not native:
        runner.draft_greedy = lambda *a: None
    proposals: Proposals = []

    def recorded(requests, budgets):
        out = propose(requests, budgets)
        proposals.append([(r.request_id, k, p.tokens) for r, k, p in zip(requests, budgets, out, strict=True)])
        return out

    engine.proposer.propose = recorded
    for i, (question, p) in enumerate(zip(QUESTIONS, GREEDY, strict=True)):
        engine.add_request(f"r{i}", engine.tokenizer.encode_chat([{"role": "user", "content": question}]), p)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step().deltas:
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
    return proposals, outputs, runner.kv_cache


@pytest.mark.parametrize("min_confidence", [0.0, 0.4])
@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_native_greedy_drafting_is_the_pass_by_pass_loop(demo_dir, draft_dtype, min_confidence):
    """`ModelRunner.draft_greedy` (a proposal's every draft pass in one native call) proposes what the
    Python loop of single passes proposes and writes the same draft-model K/V, bit for bit: over
    whole greedy generations of three sequences of different lengths at once, with the shipped
    draft, drafting the whole budget or stopping on low confidence."""
    args = EngineArgs(model=str(demo_dir), speculative_model=str(demo_draft_path(demo_dir.parent)),
                      num_speculative_tokens=4, speculative_dtype=draft_dtype,
                      speculative_min_confidence=min_confidence, max_model_len=256, num_kv_blocks=64)
    proposals, outputs, kv = _speculate(args, native=True)
    loop_proposals, loop_outputs, loop_kv = _speculate(args, native=False)
    assert proposals == loop_proposals and outputs == loop_outputs and torch.equal(kv, loop_kv)
    short = [len(t) < k for step in proposals for _, k, t in step]  # stopped on low confidence
    assert any(short) == (min_confidence > 0)


def test_native_greedy_drafting_skips_the_padding_rows_of_the_head(make_checkpoint, demo_dir, tmp_path):
    """A checkpoint whose LM head has rows past the tokenizer's vocabulary (padding), here made the
    largest logits: native drafts, like the pass-by-pass loop's, come from the vocabulary only."""
    vocab = len(load_model(demo_dir).tokenizer.backend.get_vocab())
    source = make_checkpoint("qwen3", hidden_size=128, vocab_size=vocab + 61)  # head size 32: the kernel's
    padded = tmp_path / "padded"
    shutil.copytree(source, padded)
    weights = load_file(padded / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name][vocab:] *= 50
    save_file(weights, padded / "model.safetensors", metadata={"format": "pt"})
    args = EngineArgs(model=str(padded), speculative_model=str(padded), speculative_min_confidence=0,
                      max_model_len=256, num_kv_blocks=64)
    proposals, outputs, _ = _speculate(args, native=True)
    assert (proposals, outputs) == _speculate(args, native=False)[:2]
    assert max(t for step in proposals for _, _, drafts in step for t in drafts) < vocab
