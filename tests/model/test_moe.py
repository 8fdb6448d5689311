"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) against transformers, on tiny random checkpoints
written with transformers' own classes, through the public `LLM` API; their GGUF files against
their dequantized selves and against llama.cpp; the grouped expert product against a per-token
oracle; and what is refused.

Each configuration's 32 greedy tokens are transformers' and every step's top five logprobs within
1e-4 of its log-softmax, for three prompts sharing a prefix run together on a pool too small for
all three (preemption), with a token budget below a prompt's length (chunked prefill) and the
prefix cache on. Heads of 32 values, a size the C++ attention kernel takes (the torch backend it
hands other sizes to is not batch invariant).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import UnsupportedModelError, load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.layer_ops import CpuLayerOps, TorchLayerOps, select_layer_ops
from nanoserve.model.moe import SparseMoE, grouped_moe_ffn, route
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, dequantize, quantize
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight
from nanoserve.runtime.llm import LLM

from support.forward import forward_chunks

# name: (transformers class prefix, config fields)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # layer 1 a dense MLP (mlp_only_layers), top-k renormalised
    "qwen3moe-e4k2-norm-dense-layer": ("Qwen3Moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=96, norm_topk_prob=True,
        mlp_only_layers=[1], head_dim=32, num_key_value_heads=2)),
    # not renormalised, which llama.cpp's qwen3moe always does: the file says so in a key only nanoserve reads
    "qwen3moe-e8k2": ("Qwen3Moe", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, head_dim=32,
        num_key_value_heads=2)),
    "qwen3moe-e8k4-norm": ("Qwen3Moe", dict(
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
        num_key_value_heads=4)),
    "mixtral-e4k2": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=32,
                                     num_key_value_heads=1)),
    # as many KV heads as heads: llama.cpp's olmoe reads no other
    "olmoe-e8k3": ("Olmoe", dict(num_experts=8, num_experts_per_tok=3, intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=2)),
}
WHOLE_MOE = [name for name in CONFIGS if "dense-layer" not in name]  # what llama.cpp's architectures hold
LLAMA_CPP_RULE = [name for name in WHOLE_MOE if name != "qwen3moe-e8k2"]  # renormalised as llama.cpp does
PROMPTS, PROMPT_LEN, SHARED, STEPS, TOP = 3, 40, 24, 32, 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> dict[str, Path]:
    """Each configuration saved once (save_pretrained) with the demo tokenizer, every parameter
    drawn at random."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    paths = {}
    for name, (prefix, fields) in CONFIGS.items():
        cfg = getattr(transformers, f"{prefix}Config")(**{
            "vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": None, "pad_token_id": None,
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"), **fields})
        torch.manual_seed(7)
        model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_dir / file, path / file)
        paths[name] = path
    return paths


def _prompts(vocab: int) -> list[list[int]]:
    """PROMPTS prompts of PROMPT_LEN tokens sharing their first SHARED."""
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(SHARED)]
    return [shared + [rng.randrange(vocab) for _ in range(PROMPT_LEN - SHARED)] for _ in range(PROMPTS)]


Reference = list[tuple[list[int], torch.Tensor]]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path], one_torch_thread: None) -> dict[str, Reference]:
    """Per configuration and prompt: transformers' greedy tokens and the log-softmax of its logits at
    each step [STEPS, vocab]."""
    import transformers

    refs: dict[str, Reference] = {}
    for name, path in checkpoints.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs[name] = []
        for prompt in _prompts(hf.config.vocab_size):
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            refs[name].append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().log_softmax(-1)))
    return refs


def _llm(model: Path, **args: Any) -> LLM:
    # A token budget below a prompt's length (chunked prefill); 40 blocks of 4 tokens hold two of the
    # three sequences' 72 tokens but not the third's (preemption).
    return LLM(str(model), dtype="float32", block_size=4, max_num_batched_tokens=16, max_model_len=128,
               num_kv_blocks=40, **args)


def _check(llm: LLM, reference: Reference) -> None:
    """All prompts at once: transformers' tokens and logprobs, with the shared prefix cached and at
    least one sequence preempted along the way."""
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP)
    results = llm.generate(_prompts(llm.engine.limits.vocab_size), params)
    for result, (tokens, ref) in zip(results, reference, strict=True):
        out = result.outputs[0]
        assert out.token_ids == tokens
        assert out.top_logprobs is not None
        for step, top in enumerate(out.top_logprobs):
            ids = torch.tensor([t for t, _ in top])
            ours = torch.tensor([lp for _, lp in top])
            assert (ours - ref[step, ids]).abs().max().item() < 1e-4
    assert sum(r.num_cached_tokens for r in results) >= SHARED - 4  # whole blocks of the shared prefix
    assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(checkpoints, references, name, backend):
    """CpuLayerOps (C++ products) and TorchLayerOps (the reference) alike."""
    llm = _llm(checkpoints[name], attention_backend=backend)
    assert isinstance(llm.engine.runner.model.ops, CpuLayerOps if backend == "cpu" else TorchLayerOps)
    _check(llm, references[name])


@pytest.mark.parametrize("name", WHOLE_MOE)
def test_matches_transformers_through_gguf(checkpoints, references, tmp_path, name):
    """Exported to GGUF (F32, the experts stacked as llama.cpp stacks them) and read back: the same
    config, tokens and logprobs."""
    gguf_path = export_gguf(checkpoints[name], tmp_path / f"{name}.gguf")
    assert load_model(gguf_path).config == load_model(checkpoints[name]).config
    _check(_llm(gguf_path), references[name])


@pytest.mark.parametrize("name", ["qwen3moe-e8k2", "mixtral-e4k2"])
def test_q8_0_experts_against_their_dequantized_selves(checkpoints, tmp_path, name, one_torch_thread):
    """A Q8_0 file keeps its experts as q8_0 blocks (the router F32 in the file, dense here); its
    logits are close to, not equal to, those of the same file dequantized at load (the reference
    mode: no product quantizes its activations), but at a router's near-tie; and through the
    engine, in fp32 and bf16, a batch of prompts gets each prompt's tokens and logprobs alone, bit
    for bit (batch invariance)."""
    path = export_gguf(checkpoints[name], tmp_path / "q8.gguf", "Q8_0")
    kept = load_model(path, dtype=torch.float32)
    dense = load_model(path, dtype=torch.float32, quantization="dense")
    moe = kept.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.router, DenseWeight)
    assert all(isinstance(w, BlockQuantWeight) and w.format == "q8_0" for w in (moe.gate_exps, moe.up_exps,
                                                                                 moe.down_exps))
    assert isinstance(dense.model.layers[0].mlp.gate_exps, DenseWeight)
    for loaded in (kept, dense):
        loaded.model.ops = select_layer_ops("auto", torch.device("cpu"), torch.float32)
    prompts = _prompts(kept.config.vocab_size)
    chunks = [[p[:17], p[17:], *[[t] for t in range(3, 9)]] for p in prompts]
    got, want = torch.cat(forward_chunks(kept, chunks)), torch.cat(forward_chunks(dense, chunks))
    assert not torch.equal(got, want)
    _close_but_for_router_ties(got, want, len(got) // 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), dtype=dtype, block_size=4, max_num_batched_tokens=16, max_model_len=128,
                  num_kv_blocks=80, enable_prefix_caching=False)
        together = [r.outputs[0] for r in llm.generate(prompts, params)]
        alone = [llm.generate(p, params)[0].outputs[0] for p in prompts]
        assert [(o.token_ids, o.top_logprobs) for o in together] == [(o.token_ids, o.top_logprobs) for o in alone]


def test_a_renormalisation_llama_cpp_does_not_read_is_kept_in_the_file(checkpoints, tmp_path):
    """Qwen3-MoE with norm_topk_prob false: llama.cpp's qwen3moe always renormalises, so the file
    carries `qwen3moe.expert_weights_norm` false, which nanoserve reads back; without the key a
    qwen3moe file renormalises, as llama.cpp does."""
    from nanoserve.model.checkpoint.gguf_reader import read_gguf_metadata

    for name, norm in (("qwen3moe-e8k2", False), ("qwen3moe-e8k4-norm", True)):
        path = export_gguf(checkpoints[name], tmp_path / f"{name}.gguf")
        assert read_gguf_metadata(path).get("qwen3moe.expert_weights_norm") == (None if norm else False)
        assert load_model(path).config.norm_topk_prob is norm


@pytest.mark.parametrize("name", LLAMA_CPP_RULE)
def test_llama_cpp_reads_our_files(checkpoints, tmp_path, name, one_torch_thread):
    """llama.cpp (llama-cpp-python) loads the exported F32 file and its logits over a prompt are
    transformers' to float rounding, with the same argmax at every position."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import transformers

    path = export_gguf(checkpoints[name], tmp_path / f"{name}.gguf")
    prompt = _prompts(1000)[0][:16]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt)
    theirs = torch.tensor(llm.scores[:len(prompt)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (theirs - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    assert torch.equal(theirs.argmax(-1), ref.argmax(-1))


def _close_but_for_router_ties(got: torch.Tensor, want: torch.Tensor, ties: int) -> None:
    """Logits [positions, vocab] within 3% of the largest of `want` at every position but at most
    `ties`: where a router's top-k sits at a near-tie, quantized activations (on either side) may
    pick another expert, which moves that position's logits further."""
    far = (got - want).abs().amax(dim=-1) >= 0.03 * want.abs().max().item()
    assert far.sum().item() <= ties, far.nonzero().flatten().tolist()


def _random_blocks(fmt: str, rows: int, in_features: int, g: torch.Generator) -> BlockQuantWeight:
    """Valid blocks: q8_0 / q4_0 quantized from normal values; k-quants random bytes with fp16 scales
    in +-[1e-3, 4e-3] (nanoserve has no k-quant quantizer)."""
    if fmt in ("q8_0", "q4_0"):
        blocks = quantize(torch.randn(rows, in_features, generator=g) * 0.5, fmt)
        return BlockQuantWeight(fmt, blocks, in_features, torch.float32)
    w = BlockQuantWeight.empty(fmt, rows, in_features)
    w.blocks.copy_(torch.randint(0, 256, w.blocks.shape, generator=g, dtype=torch.uint8))
    blocks = w.blocks.view(-1, BLOCK_FORMATS[fmt].type_size)
    for at in {"q4_k": (0, 2), "q6_k": (208,)}[fmt]:
        scales = (torch.rand(blocks.shape[0], generator=g) * 3e-3 + 1e-3) * (
            torch.randint(0, 2, (blocks.shape[0],), generator=g) * 2 - 1)
        blocks[:, at:at + 2] = scales.to(torch.float16).view(torch.uint8).view(-1, 2)
    return w


def _weight(fmt: str, rows: int, in_features: int, g: torch.Generator) -> LinearWeight:
    if fmt == "dense":
        return DenseWeight(torch.randn(rows, in_features, generator=g) * 0.2)
    return _random_blocks(fmt, rows, in_features, g)


def _oracle(x: torch.Tensor, weights: list[LinearWeight], ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, on the dequantized matrices in plain torch."""
    gate, up, down = (dequantize(m) if isinstance(m, BlockQuantWeight) else m.weight  # type: ignore[union-attr]
                      for m in weights)
    experts = gate.shape[0] // down.shape[1]
    i, h = down.shape[1], down.shape[0] // experts
    out = torch.zeros(x.shape[0], h)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = torch.nn.functional.silu(gate[e * i:(e + 1) * i] @ x[t]) * (up[e * i:(e + 1) * i] @ x[t])
            out[t] += w[t, j] * (down[e * h:(e + 1) * h] @ a)
    return out


# (gate, up, down) formats: dense, one format for all, and a Q4_K_M file's mix (q4_k gate/up, q6_k down)
FORMAT_SETS = [("dense", "dense", "dense"), ("q8_0", "q8_0", "q8_0"), ("q4_k", "q4_k", "q6_k"),
               ("q4_0", "dense", "q8_0")]
EXPERTS, INTER, HIDDEN, TOP_K = 6, 256, 256, 2


@pytest.mark.parametrize("formats", FORMAT_SETS, ids="-".join)
def test_grouped_experts_against_a_per_token_oracle(formats, one_torch_thread):
    """`grouped_moe_ffn` on both ops is the per-token sum over the dequantized experts (TorchLayerOps
    to float rounding; CpuLayerOps within its activation quantization for block formats); on
    CpuLayerOps each token's row is the same bits alone as in the batch; an expert no token chose
    is never read (its rows are NaN here)."""
    g = torch.Generator().manual_seed(5)
    weights = [_weight(formats[0], EXPERTS * INTER, HIDDEN, g), _weight(formats[1], EXPERTS * INTER, HIDDEN, g),
               _weight(formats[2], EXPERTS * HIDDEN, INTER, g)]
    tokens = 9
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=g)[:TOP_K] for _ in range(tokens)])  # the last unused
    w = torch.rand(tokens, TOP_K, generator=g)
    for m in weights:  # the unused expert's rows poisoned
        rows = m.out_features // EXPERTS
        if isinstance(m, DenseWeight):
            m.weight[(EXPERTS - 1) * rows:] = float("nan")
        else:
            assert isinstance(m, BlockQuantWeight)
            m.blocks[(EXPERTS - 1) * rows:] = 0xFF  # fp16 scales of all ones: NaN
    want = _oracle(x, weights, ids, w)
    ops_list: list[Any] = [TorchLayerOps()]
    cpu = select_layer_ops("cpu", torch.device("cpu"), torch.float32)
    if isinstance(cpu, CpuLayerOps):
        ops_list.append(cpu)
    for ops in ops_list:
        got = ops.moe_ffn(x, *weights, ids, w)
        assert got.shape == (tokens, HIDDEN) and got.dtype == torch.float32 and torch.isfinite(got).all()
        exact = isinstance(ops, TorchLayerOps) or formats == ("dense", "dense", "dense")
        tolerance = 1e-4 if exact else 0.03
        assert (got - want).abs().max().item() <= tolerance * want.abs().max().item(), type(ops).__name__
        if isinstance(ops, CpuLayerOps):
            for t in (0, 4, tokens - 1):
                assert torch.equal(ops.moe_ffn(x[t:t + 1].contiguous(), *weights, ids[t:t + 1], w[t:t + 1]),
                                   got[t:t + 1])
    with pytest.raises(IndexError, match="expert id"):
        grouped_moe_ffn(TorchLayerOps(), x, *weights, torch.full_like(ids, EXPERTS), w)


def test_routing_is_each_family_s_router(one_torch_thread):
    """`route` against transformers' own router modules: Mixtral's (renormalised, fp32 weights),
    Qwen3-MoE's and OLMoE's (renormalised or not, weights rounded to the model's dtype), in bf16."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 32, generator=g).to(torch.bfloat16)
    cases = [(MixtralTopKRouter(transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)),
              True, None)]
    for norm in (False, True):
        fields = dict(hidden_size=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        cases.append((Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(**fields)), norm, torch.bfloat16))
        cases.append((OlmoeTopKRouter(transformers.OlmoeConfig(**fields)), norm, torch.bfloat16))
    for router, norm, weights_dtype in cases:
        router = router.to(torch.bfloat16)
        with torch.no_grad():
            router.weight.normal_(0.0, 1.0, generator=g)
            _, scores, indices = router(x)
        ids, weights = route(torch.nn.functional.linear(x, router.weight), router.top_k, norm, weights_dtype)
        assert torch.equal(ids, indices)
        assert weights.dtype == torch.float32 and torch.equal(weights, scores.float()), type(router).__name__


def _edited(src: Path, dst: Path, **fields: Any) -> Path:
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


@pytest.mark.parametrize(("name", "fields", "message"), [
    ("olmoe-e8k3", {"clip_qkv": 8.0}, "clip_qkv"),
    ("qwen3moe-e8k2", {"shared_expert_intermediate_size": 64}, "shared experts"),
    ("mixtral-e4k2", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3moe-e8k2", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
])
def test_what_is_not_implemented_is_refused_by_name(checkpoints, tmp_path, name, fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(_edited(checkpoints[name], tmp_path, **fields))


def test_mixture_of_experts_config_and_the_paths_that_decline_it(checkpoints, tmp_path):
    """The dense layer of a Qwen3-MoE checkpoint is a dense MLP; tensor parallelism refuses MoE by
    name; the native decoder is not built (the Python forward runs) and refuses to be constructed;
    llama.cpp's qwen3moe has experts in every layer, so the export refuses a dense layer among them."""
    from nanoserve.attention import select_backend
    from nanoserve.model.native_decoder import NativeDecoder
    from nanoserve.parallel.megatron import shard_config

    loaded = load_model(checkpoints["qwen3moe-e4k2-norm-dense-layer"], dtype=torch.float32)
    cfg = loaded.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.moe_layers) == ("qwen3_moe", 4, 2, 64, True, (0,))
    assert isinstance(loaded.model.layers[0].mlp, SparseMoE) and not isinstance(loaded.model.layers[1].mlp, SparseMoE)
    assert cfg.num_params == sum(p.numel() for p in loaded.model.parameters())
    with pytest.raises(ValueError, match="tensor parallelism does not implement mixture-of-experts"):
        shard_config(cfg, 2)
    with pytest.raises(ValueError, match="dense MLP layers among the experts"):
        export_gguf(checkpoints["qwen3moe-e4k2-norm-dense-layer"], tmp_path / "x.gguf")
    ops = select_layer_ops("cpu", torch.device("cpu"), torch.float32)
    if not isinstance(ops, CpuLayerOps):
        return
    loaded.model.ops = ops
    assert NativeDecoder.build(loaded.model, select_backend("cpu", torch.device("cpu"))) is None
    with pytest.raises(ValueError, match="does not implement"):
        NativeDecoder(loaded.model, ops)


def test_a_checkpoint_missing_an_expert_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints["mixtral-e4k2"]
    dst = _edited(src, tmp_path)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, dst / "model.safetensors")
    from nanoserve.model.checkpoint.weights import MissingWeightsError

    with pytest.raises(MissingWeightsError, match="missing 1 tensors"):
        load_model(dst)


def test_a_q4_k_m_file_quantized_by_llama_cpp(tmp_path, demo_dir, one_torch_thread):
    """llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`) makes a Q4_K_M file of an
    exported Qwen3-MoE: nanoserve keeps its experts as q4_k (gate, up) and q6_k (down) blocks, and
    its logits over a prompt are close to those of the same file dequantized at load (the reference
    mode) and to llama.cpp's on that file, position by position but where a router's near-tie flips."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=256, bos_token_id=None, pad_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(1)
    folder = tmp_path / "hf"
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / file, folder / file)
    f32 = export_gguf(folder, tmp_path / "f32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 1
    q4 = tmp_path / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), ctypes.byref(params)) == 0
    kept = load_model(q4, dtype=torch.float32)
    dense = load_model(q4, dtype=torch.float32, quantization="dense")
    moe = kept.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    assert [(w.format if isinstance(w, BlockQuantWeight) else "dense") for w in (moe.gate_exps, moe.up_exps,
                                                                                 moe.down_exps)] == [
        "q4_k", "q4_k", "q6_k"]
    for loaded in (kept, dense):
        loaded.model.ops = select_layer_ops("auto", torch.device("cpu"), torch.float32)
    prompt = _prompts(len(tok))[0][:16]
    ours, reference = forward_chunks(kept, [[prompt]])[0], forward_chunks(dense, [[prompt]])[0]
    llm = llama_cpp.Llama(str(q4), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(prompt)
    theirs = torch.tensor(llm.scores[:len(prompt)])
    for other in (reference, theirs):
        _close_but_for_router_ties(ours, other, 2)


@pytest.mark.parametrize("name", ["qwen3moe-e8k2", "mixtral-e4k2"])
def test_transformers_fused_expert_layout(checkpoints, tmp_path, name):
    """A checkpoint saved in transformers' own fused layout (`save_original_format=False`:
    `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`,
    Mixtral's too) loads to the same weights as the per-expert one, and exports to the same GGUF
    tensors."""
    import transformers
    from safetensors import safe_open

    fused = tmp_path / "fused"
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32)
    hf.save_pretrained(fused, save_original_format=False)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints[name] / file, fused / file)
    with safe_open(fused / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    ours = load_model(fused, dtype=torch.float32).model
    theirs = load_model(checkpoints[name], dtype=torch.float32).model
    for (key, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    from nanoserve.model.checkpoint.gguf_reader import read_gguf

    files = [read_gguf(export_gguf(folder, tmp_path / f"{i}.gguf"))
             for i, folder in enumerate((fused, checkpoints[name]))]
    tensors = [{t.name: t.data for t in f.tensors} for f in files]
    assert tensors[0].keys() == tensors[1].keys()
    assert all((tensors[0][k] == tensors[1][k]).all() for k in tensors[0])


def test_int8_quantizes_experts_and_dense_mlps_at_load(checkpoints):
    """`--quantization int8` on a safetensors checkpoint: the experts of the MoE layer and the dense
    MLP of the other are q8_0, the router dense; the loaded matrices are the checkpoint's quantized."""
    path = checkpoints["qwen3moe-e4k2-norm-dense-layer"]
    quantized = load_model(path, dtype=torch.float32, quantization="int8").model
    dense = load_model(path, dtype=torch.float32).model
    moe, mlp = quantized.layers[0].mlp, quantized.layers[1].dense_mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.router, DenseWeight)
    for ours, theirs in ((moe.gate_exps, dense.layers[0].mlp.gate_exps), (moe.down_exps, dense.layers[0].mlp.down_exps),
                         (mlp.gate_up_proj, dense.layers[1].dense_mlp.gate_up_proj)):
        assert isinstance(ours, BlockQuantWeight) and ours.format == "q8_0" and isinstance(theirs, DenseWeight)
        assert torch.equal(ours.blocks, quantize(theirs.weight, "q8_0"))
