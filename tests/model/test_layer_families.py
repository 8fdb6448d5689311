"""Families whose layers differ from Llama's (Gemma 3, OLMo 2) against transformers on tiny random
checkpoints written with transformers' own classes, through the public `LLM` API.

Each configuration's logprobs (every generated step's top five) are within 1e-4 of transformers'
log-softmax and its 32 greedy tokens identical, in paged and contiguous KV modes, with prompts
longer than the token budget (chunked prefill) and than the local layers' windows, a second prompt
sharing the first's prefix (a prefix-cache hit, paged), and again from the GGUF file the checkpoint
exports to.
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
from nanoserve.runtime.llm import LLM

LAYERS = ("sliding_attention", "full_attention")
# name: (transformers class prefix, config fields)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3-tied-gqa": ("Gemma3", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, sliding_window=6,
        layer_types=[LAYERS[0], LAYERS[1], LAYERS[0]], query_pre_attn_scalar=24, final_logit_softcapping=20.0,
        rope_theta=1e6, rope_local_base_freq=1e4)),
    "gemma3-untied-mqa": ("Gemma3", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False, sliding_window=5,
        layer_types=[LAYERS[1], LAYERS[0]], query_pre_attn_scalar=32)),
    "olmo2-untied-gqa": ("Olmo2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "olmo2-tied-mqa": ("Olmo2", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
}
PROMPT_LEN, SHARED, STEPS, TOP = 40, 24, 32, 5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> dict[str, Path]:
    """Each configuration saved once (save_pretrained) with the demo tokenizer; every parameter
    drawn at random (norm weights too, so (1 + w) norms are exercised)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    paths = {}
    for name, (prefix, fields) in CONFIGS.items():
        config_class = getattr(transformers, "Gemma3TextConfig" if prefix == "Gemma3" else f"{prefix}Config")
        cfg = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                           num_hidden_layers=len(fields.get("layer_types", [0, 0])), head_dim=32,
                           max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None, pad_token_id=None,
                           eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), **fields)
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
    """Two prompts of PROMPT_LEN tokens sharing their first SHARED."""
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(SHARED)]
    return [shared + [rng.randrange(vocab) for _ in range(PROMPT_LEN - SHARED)] for _ in range(2)]


Reference = dict[str, list[tuple[list[int], torch.Tensor]]]


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path], one_torch_thread: None) -> Reference:
    """Per configuration and prompt: transformers' greedy tokens and the log-softmax of its logits at
    each step [STEPS, vocab]."""
    import transformers

    refs: Reference = {}
    for name, path in checkpoints.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs[name] = []
        for prompt in _prompts(hf.config.vocab_size):
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            refs[name].append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().log_softmax(-1)))
    return refs


def _check(llm: LLM, reference: list[tuple[list[int], torch.Tensor]], paged: bool) -> None:
    prompts = _prompts(llm.engine.limits.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=TOP)
    for i, (prompt, (tokens, ref)) in enumerate(zip(prompts, reference, strict=True)):
        # One at a time: the second prompt finds the first's prefix cached.
        (result,) = llm.generate(prompt, params)
        out = result.outputs[0]
        assert out.token_ids == tokens
        assert out.top_logprobs is not None
        for step, top in enumerate(out.top_logprobs):
            ids = torch.tensor([t for t, _ in top])
            ours = torch.tensor([lp for _, lp in top])
            assert (ours - ref[step, ids]).abs().max().item() < 1e-4
        if paged and i == 1:
            assert result.num_cached_tokens >= SHARED - 8  # whole blocks of the shared prefix


def _llm(model: Path, kv: str) -> LLM:
    # A token budget below the prompt's length: prompts are prefilled in chunks.
    return LLM(str(model), dtype="float32", kv=kv, block_size=4, max_num_batched_tokens=16, max_model_len=128,
               num_kv_blocks=256)


@pytest.mark.parametrize("kv", ["paged", "contiguous"])
@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(checkpoints, references, name, kv):
    _check(_llm(checkpoints[name], kv), references[name], kv == "paged")


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers_through_gguf(checkpoints, references, tmp_path, name):
    """Exported to GGUF (F32) and read back: the same tokens and logprobs; the file's metadata
    carries the layer shape (windows, local rotary base, attention scale, softcap)."""
    gguf_path = export_gguf(checkpoints[name], tmp_path / f"{name}.gguf")
    direct, through = load_model(checkpoints[name]).config, load_model(gguf_path).config
    assert through == direct
    _check(_llm(gguf_path, "paged"), references[name], paged=True)


def test_text_decoder_of_a_multimodal_gemma3_checkpoint(checkpoints, tmp_path_factory, demo_dir, one_torch_thread):
    """A Gemma3ForConditionalGeneration checkpoint (its text decoder nested in `text_config` and
    under `language_model.`, beside a vision tower) runs its text decoder: the same greedy tokens
    and logprobs as transformers' multimodal model on text prompts, also from the GGUF file its
    text decoder exports to."""
    import transformers

    text = json.loads((checkpoints["gemma3-untied-mqa"] / "config.json").read_text())
    text["tie_word_embeddings"] = True
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    vocab = text["vocab_size"]
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3)
    torch.manual_seed(11)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("gemma3-multimodal")
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / file, path / file)
    reference = []
    for prompt in _prompts(vocab):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        reference.append((out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float().log_softmax(-1)))
    _check(_llm(path, "paged"), reference, paged=True)
    gguf_path = export_gguf(path, tmp_path_factory.mktemp("gemma3-multimodal-gguf") / "text.gguf")
    assert load_model(gguf_path).config == load_model(path).config
    _check(_llm(gguf_path, "paged"), reference, paged=True)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden_act 'relu'"),
    ("layer_types", ["chunked_attention", "full_attention", "full_attention"], "layer_types"),
])
def test_unsupported_gemma3_fields_are_named(checkpoints, tmp_path, field, value, message):
    src = checkpoints["gemma3-tied-gqa"]
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(tmp_path)


@pytest.mark.parametrize("name", ["gemma3-tied-gqa", "olmo2-tied-mqa"])
def test_paths_that_implement_llama_layers_only_decline(checkpoints, name):
    """Tensor parallelism refuses these layers by name; the native decoder is not built for them
    (the Python forward runs) and refuses to be constructed directly."""
    from nanoserve.attention import select_backend
    from nanoserve.model.layer_ops import CpuLayerOps, select_layer_ops
    from nanoserve.model.native_decoder import NativeDecoder
    from nanoserve.parallel.megatron import shard_config

    loaded = load_model(checkpoints[name], dtype=torch.float32)
    with pytest.raises(ValueError, match="tensor parallelism does not implement"):
        shard_config(loaded.config, 2)
    if shutil.which("g++") is None:
        return
    loaded.model.ops = ops = select_layer_ops("cpu", torch.device("cpu"), torch.float32)
    assert isinstance(ops, CpuLayerOps)
    assert NativeDecoder.build(loaded.model, select_backend("cpu", torch.device("cpu"))) is None
    with pytest.raises(ValueError, match="does not implement"):
        NativeDecoder(loaded.model, ops)


def test_gemma_scales_set_the_multipliers_granite_reads(checkpoints):
    """Gemma's sqrt(hidden) embedding scale and query_pre_attn_scalar land on the one set of
    multiplier fields Granite's config.json sets (the decoder reads no other); a Granite config
    with query_pre_attn_scalar is refused by name rather than one scale silently winning."""
    from nanoserve.model.config import ModelConfig

    gemma = json.loads((checkpoints["gemma3-tied-gqa"] / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(gemma)
    assert (cfg.embedding_multiplier, cfg.attention_scale, cfg.logits_scaling, cfg.final_logit_softcap) == (
        64**0.5, 24**-0.5, 1.0, 20.0)
    granite = {"architectures": ["GraniteForCausalLM"], "vocab_size": 32, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "attention_multiplier": 0.2, "embedding_multiplier": 12.0}
    cfg = ModelConfig.from_hf_dict(granite)
    assert (cfg.embedding_multiplier, cfg.attention_scale, cfg.final_logit_softcap) == (12.0, 0.2, None)
    with pytest.raises(UnsupportedModelError, match="query_pre_attn_scalar"):
        ModelConfig.from_hf_dict({**granite, "query_pre_attn_scalar": 16})
