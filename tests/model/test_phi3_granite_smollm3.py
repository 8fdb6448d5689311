"""Phi-3 / Phi-4-mini, Granite 3.x and SmolLM3 against transformers (fp32), from config.json +
safetensors and through GGUF export and back.

Each configuration is a tiny random checkpoint written by transformers' own classes, chosen to
exercise one family's switches: fused q/k/v and gate/up tensors, partial rotary, LongRoPE with its
long factors (prompts past the original context) and with its short ones, a sliding window wider
than the test's sequences, Granite's four multipliers, SmolLM3's rotary-free layers (by its
interval and by an explicit list); tied and untied heads, GQA and MQA.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.attention.cpu_paged import CpuPagedAttention, load_paged_attention
from nanoserve.model import LoadedModel, UnsupportedModelError, load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.checkpoint.gguf_reader import read_gguf_metadata
from nanoserve.model.layer_ops import CpuLayerOps, TorchLayerOps, select_layer_ops
from nanoserve.model.native_decoder import NativeDecoder
from nanoserve.model.quant.block_quant import BlockQuantWeight
from nanoserve.native import load_cpu_kernels

from support.forward import forward_chunks, full_logits, paged_batch

NEW_TOKENS = 32
# Past the LongRoPE configurations' original context (32), so transformers takes the long factors
# for the whole sequence, as nanoserve does for a model whose context exceeds the original one.
PROMPT_LENGTHS = (37, 70)
ORIGINAL_CONTEXT = 32


def _factors(n: int, first: float, step: float) -> list[float]:
    return [first + step * i for i in range(n)]


# name -> (transformers class prefix, config overrides). head_dim is 64 / 4 = 16.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("Phi3", dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=200)),
    # Phi-4-mini's shape: rotary over 3/4 of each head (12 dims, 6 factors), tied, LongRoPE.
    "phi4-mini-longrope": ("Phi3", dict(
        num_key_value_heads=1, tie_word_embeddings=True, partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL_CONTEXT,  # Phi3Config takes the top-level one
        rope_scaling={"type": "longrope", "original_max_position_embeddings": ORIGINAL_CONTEXT,
                      "short_factor": _factors(6, 1.0, 0.1), "long_factor": _factors(6, 2.0, 0.7)})),
    # The older "su" name, the model's context no longer than the original one: short factors,
    # and an explicit attention factor.
    "phi3-su-short": ("Phi3", dict(
        num_key_value_heads=2, tie_word_embeddings=False, original_max_position_embeddings=512,
        rope_scaling={"type": "su", "original_max_position_embeddings": 512, "attention_factor": 1.2,
                      "short_factor": _factors(8, 1.0, 0.3), "long_factor": _factors(8, 4.0, 1.0)})),
    "granite": ("Granite", dict(num_key_value_heads=2, tie_word_embeddings=False, embedding_multiplier=12.0,
                                residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=8.0)),
    "granite-mqa-tied": ("Granite", dict(num_key_value_heads=1, tie_word_embeddings=True, embedding_multiplier=3.0,
                                         residual_multiplier=0.5, attention_multiplier=0.0625, logits_scaling=2.5)),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "smollm3-listed": ("SmolLM3", dict(num_key_value_heads=1, tie_word_embeddings=False, no_rope_layers=[0, 1])),
}
# llama.cpp's smollm3 always takes every fourth layer rotary-free: a listed pattern has no GGUF form.
GGUF_CONFIGS = [name for name in CONFIGS if name != "smollm3-listed"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "paged+prefix": dict(),
    "contiguous": dict(kv="contiguous"),
    "chunked": dict(max_num_batched_tokens=8, block_size=4, enable_prefix_caching=False),
}


class Reference:
    """One configuration's checkpoint, loaded, with transformers' logits and greedy continuations."""

    def __init__(self, path: Path, seqs: list[list[int]]) -> None:
        import transformers

        self.path = path
        self.seqs = seqs
        self.loaded = load_model(path, dtype=torch.float32)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            self.logits = [hf(torch.tensor([s])).logits[0] for s in seqs]
            self.greedy = [hf.generate(torch.tensor([s]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                       do_sample=False, pad_token_id=0)[0, len(s):].tolist() for s in seqs]


def _write_checkpoint(name: str, path: Path, demo_dir: Path, **extra: Any) -> int:
    """Writes configuration `name` (with `extra` overrides) as transformers saves it, with the demo
    tokenizer, to `path`; returns the vocabulary size."""
    import transformers

    cls, overrides = CONFIGS[name]
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    fields: dict[str, Any] = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    cfg = getattr(transformers, f"{cls}Config")(**{**fields, **overrides, **extra})
    torch.manual_seed(1234)
    getattr(transformers, f"{cls}ForCausalLM")(cfg).eval().save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / f, path / f)
    return len(tok)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path):
    """name -> Reference, each built once per module on first use."""
    built: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in built:
            path = tmp_path_factory.mktemp(f"ckpt-{name}")
            vocab = _write_checkpoint(name, path, demo_dir)
            rng = random.Random(len(built))
            built[name] = Reference(path, [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS])
        return built[name]

    return get


def _max_diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max((o - r).abs().max().item() for o, r in zip(ours, ref, strict=True))


def _chunks(seqs: list[list[int]]) -> list[list[list[int]]]:
    return [[s[:1], s[1:9], s[9:]] for s in seqs]


def test_switches_read_from_config_json(reference):
    """What each checkpoint's config.json sets reaches the decoder's switches."""
    phi4, su = reference("phi4-mini-longrope").loaded.config, reference("phi3-su-short").loaded.config
    assert (phi4.rotary_dim, phi4.rope_scaling.rope_type, phi4.longrope_long) == (12, "longrope", True)
    assert phi4.rope_attention_factor == pytest.approx((1 + torch.log(torch.tensor(16.0)).item()
                                                        / torch.log(torch.tensor(32.0)).item()) ** 0.5)
    assert (su.rope_scaling.rope_type, su.longrope_long, su.rope_attention_factor) == ("longrope", False, 1.2)
    assert reference("phi3").loaded.config.sliding_window == 200
    granite = reference("granite").loaded.config
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_scale,
            granite.logits_scaling) == (12.0, 0.22, 0.2, 8.0)
    assert reference("smollm3").loaded.config.no_rope_layers == (3,)
    assert reference("smollm3-listed").loaded.config.no_rope_layers == (0,)


@pytest.mark.parametrize("ops", ["torch", "cpu"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(reference, name, ops):
    """Whole sequences and the same sequences in uneven chunks (later chunks attend to a cached
    prefix), with the reference layer ops and with the fused C++ ones (where g++ exists)."""
    if ops == "cpu" and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine")
    ref = reference(name)
    loaded = ref.loaded
    loaded.model.ops = select_layer_ops(ops, torch.device("cpu"), torch.float32)
    assert isinstance(loaded.model.ops, CpuLayerOps if ops == "cpu" else TorchLayerOps)
    try:
        assert _max_diff(full_logits(loaded, ref.seqs), ref.logits) < 1e-4
        assert _max_diff(forward_chunks(loaded, _chunks(ref.seqs)), ref.logits) < 1e-4
    finally:
        loaded.model.ops = TorchLayerOps()


def _assert_greedy(loaded: LoadedModel, ref: Reference, mode: str) -> None:
    llm = LLM(loaded=loaded, max_model_len=128, **MODES[mode])
    outs = llm.generate(ref.seqs, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref.greedy
    if mode == "paged+prefix":  # again: the prompts' full blocks now come from the prefix cache
        again = llm.generate(ref.seqs, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == ref.greedy
        assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv_stats().blocks_used == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_transformers(reference, name, mode):
    """32 greedy tokens per prompt through the public LLM API, batched, equal to transformers'
    `generate`, in paged (with prefix-cache hits) and contiguous KV modes and with chunked prefill."""
    ref = reference(name)
    _assert_greedy(ref.loaded, ref, mode)


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory: pytest.TempPathFactory):
    """name -> (GGUF F32 file of that checkpoint, loaded), each exported once."""
    done: dict[str, tuple[Path, LoadedModel]] = {}

    def get(name: str) -> tuple[Path, LoadedModel]:
        if name not in done:
            path = export_gguf(reference(name).path, tmp_path_factory.mktemp("gguf") / f"{name}.gguf")
            done[name] = (path, load_model(path, dtype=torch.float32))
        return done[name]

    return get


@pytest.mark.parametrize("name", GGUF_CONFIGS)
def test_gguf_round_trip(reference, exported, name):
    """Exported as llama.cpp stores the family and read back: the same switches, the
    safetensors model's logits (F32: exactly), and transformers' greedy tokens through LLM in
    paged mode with chunked prefill."""
    ref = reference(name)
    _, loaded = exported(name)
    ours, theirs = ref.loaded.config, loaded.config
    # The attention factor passes through a float32 key, as llama.cpp's converter writes it.
    assert theirs.rope_attention_factor == pytest.approx(ours.rope_attention_factor, rel=1e-7)
    assert dataclasses.replace(theirs.rope_scaling, attention_factor=None) == dataclasses.replace(
        ours.rope_scaling, attention_factor=None)
    for field in ("family", "rotary_dim", "longrope_long", "sliding_window",
                  "embedding_multiplier", "residual_multiplier", "attention_scale", "logits_scaling", "no_rope_layers",
                  "tie_word_embeddings", "num_key_value_heads"):
        assert getattr(theirs, field) == getattr(ours, field), field
    assert _max_diff(full_logits(loaded, ref.seqs), full_logits(ref.loaded, ref.seqs)) < 1e-5
    _assert_greedy(loaded, ref, "chunked")


@pytest.mark.parametrize("name", ["phi3", "granite"])
def test_q8_0_gguf_keeps_blocks_of_fused_tensors(reference, tmp_path, name):
    """A Q8_0 file's matrices stay Q8_0 blocks, Phi-3's fused attn_qkv and ffn_up included, and
    the logits stay near the fp32 model's (the tolerance of tests/model/test_gguf.py)."""
    ref = reference(name)
    loaded = load_model(export_gguf(ref.path, tmp_path / "q8.gguf", "Q8_0"), dtype=torch.float32)
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, BlockQuantWeight)
    assert isinstance(layer.mlp.gate_up_proj, BlockQuantWeight)
    assert _max_diff(full_logits(loaded, ref.seqs), ref.logits) < 0.3


def test_gguf_names_and_keys_are_llama_cpp_s(exported):
    """The tensor names and metadata keys llama.cpp's phi3 and granite read."""
    phi4, _ = exported("phi4-mini-longrope")
    names = {t.name for t in gguf.GGUFReader(phi4).tensors}
    assert {"rope_factors_long.weight", "rope_factors_short.weight", "blk.0.attn_qkv.weight",
            "blk.0.ffn_up.weight"} <= names and "blk.0.attn_q.weight" not in names and "output.weight" not in names
    meta = read_gguf_metadata(phi4)
    assert meta["phi3.rope.dimension_count"] == 12
    assert meta["phi3.rope.scaling.original_context_length"] == ORIGINAL_CONTEXT
    granite, _ = exported("granite")
    meta = read_gguf_metadata(granite)
    assert (meta["granite.embedding_scale"], meta["granite.residual_scale"], meta["granite.attention.scale"],
            meta["granite.logit_scale"]) == (12.0, 0.22, 0.2, 8.0)


def test_smollm3_gguf_refuses_layers_llama_cpp_would_rotate(reference, tmp_path):
    with pytest.raises(ValueError, match=r"layers \[0\] without rotary; llama.cpp's smollm3 takes every 4th"):
        export_gguf(reference("smollm3-listed").path, tmp_path / "x.gguf")


def test_partial_rotary_refused_where_the_family_has_none(make_checkpoint, tmp_path):
    """A Llama config.json with a partial_rotary_factor: transformers' Llama would not read it either
    way we guessed, so it is refused by name."""
    src = make_checkpoint("llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"partial_rotary_factor=0\.5 for llama"):
        load_model(tmp_path)


# Head size 32 (hidden 128 over 4 heads): one the C++ attention kernel is built for.
NATIVE = {"phi3-su-short": dict(hidden_size=128, rope_scaling={
              "type": "su", "original_max_position_embeddings": 512, "attention_factor": 1.2,
              "short_factor": _factors(16, 1.0, 0.3), "long_factor": _factors(16, 4.0, 1.0)}),
          "smollm3": dict(hidden_size=128),
          "phi4-mini-longrope": dict(hidden_size=128, rope_scaling={
              "type": "longrope", "original_max_position_embeddings": ORIGINAL_CONTEXT,
              "short_factor": _factors(12, 1.0, 0.1), "long_factor": _factors(12, 2.0, 0.7)})}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NATIVE)
def test_native_decoder_gives_the_python_forward_s_bits(demo_dir, tmp_path, name, dtype):
    """The C++ decoder runs Phi-3 (LongRoPE's scaled tables) and SmolLM3 (its rotary-free layers
    skipped) to the hidden states and K/V of the Python forward on the same C++ steps, bit for bit;
    it declines partial rotary (Phi-4-mini) and Granite's multipliers."""
    lib, kernel = load_cpu_kernels(), load_paged_attention()
    assert lib is not None and kernel is not None
    ops, backend = CpuLayerOps(lib), CpuPagedAttention(kernel)
    _write_checkpoint(name, tmp_path, demo_dir, **NATIVE[name])
    loaded = load_model(tmp_path, dtype=dtype)
    loaded.model.ops = ops
    native = NativeDecoder.build(loaded.model, backend)
    if name == "phi4-mini-longrope":
        assert native is None
        return
    assert native is not None
    cfg = loaded.config
    specs = [(1, 1), (40, 1), (45, 5)]  # decodes and a short chunk, past the original context
    num_blocks = sum(-(-s // 8) for s, _ in specs) + 2
    meta = paged_batch(specs, 8, num_blocks, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(cfg.vocab_size, (meta.query_start_loc_cpu[-1],), generator=g)
    positions = torch.cat([torch.arange(s - q, s) for s, q in specs])
    kv = torch.randn(cfg.num_hidden_layers, 2, num_blocks, 8, cfg.num_key_value_heads, cfg.head_dim,
                     generator=g).to(dtype)
    kv_native = kv.clone()
    assert torch.equal(native(ids, positions, kv_native, meta), loaded.model(ids, positions, kv, meta, backend))
    assert torch.equal(kv_native, kv)


def test_native_decoder_declines_granite(reference):
    kernel = load_paged_attention()
    loaded = reference("granite").loaded
    assert not loaded.config.native_decoder
    if kernel is not None:
        assert NativeDecoder.build(loaded.model, CpuPagedAttention(kernel)) is None


def test_longrope_factors_of_the_wrong_length_refused(reference, tmp_path):
    src = reference("phi3-su-short").path
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["short_factor"] = cfg["rope_parameters"]["short_factor"][:-1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="must have 8 entries"):
        load_model(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granite", "phi3"])
def test_tensor_parallel_greedy_equals_transformers(reference, name):
    """Two ranks: Granite's multipliers on the vocab-parallel embedding and logits, Phi-3's fused
    q/k/v and gate/up sharded by blocks."""
    ref = reference(name)
    llm = LLM(str(ref.path), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        outs = llm.generate(ref.seqs, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == ref.greedy
    finally:
        llm.engine.close()


@pytest.mark.peers
@pytest.mark.parametrize("name", GGUF_CONFIGS)
def test_llama_cpp_reads_our_gguf_with_the_same_logits(reference, tmp_path, name):
    """llama.cpp, the referee for the GGUF conventions (fused phi3 tensors, rotary dimensions,
    LongRoPE factors and attention factor, Granite's scales, SmolLM3's every-fourth rotary-free
    layers, interleaved Q/K rows), gives our logits on our F32 export, with an F32 KV cache. The
    checkpoint is copied under a neutral name first: llama.cpp sets attributes on Phi-3's own
    special tokens, by name, for any model whose general.name contains "phi3", and fails on a
    vocabulary without them."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install .[bench])")
    ref = reference(name)
    src = shutil.copytree(ref.path, tmp_path / "tiny-random")
    path = export_gguf(src, tmp_path / "model.gguf")
    ids = ref.seqs[1]
    ours = full_logits(ref.loaded, [ids])[0]
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
                          type_k=f32, type_v=f32)
    try:
        llm.eval(ids)
        theirs = torch.tensor(llm.scores[: len(ids)])
    finally:
        llm.close()
    assert (theirs - ours).abs().max().item() < 1e-4


def test_longrope_follows_the_served_context(reference):
    """Served with a context within the original one, a LongRoPE model takes its short factors
    (llama.cpp's rule, by its context size), and then equals transformers on sequences that stay
    within it; the same weights served longer take the long factors (the other tests)."""
    import transformers

    ref = reference("phi4-mini-longrope")
    prompt = ref.seqs[0][:10]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    loaded = load_model(ref.path, dtype=torch.float32)
    long_inv_freq = loaded.model.inv_freq.clone()
    llm = LLM(loaded=loaded, max_model_len=ORIGINAL_CONTEXT)
    assert not torch.equal(loaded.model.inv_freq, long_inv_freq)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == expected
