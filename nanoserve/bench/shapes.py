"""`--model-shape` presets: random-weight checkpoints with the exact shapes of real models.

`shape_checkpoint("qwen3-0.6b")` writes (once, under $NANOSERVE_CACHE) an ordinary Hugging Face
folder whose config.json is the real model's (layers, widths, heads, head_dim, rope, tied
embeddings and the real vocab_size), with random weights (normal, std = initializer_range;
norms 1) stored in bf16 as the real checkpoints are, and the demo model's tokenizer. Throughput
then matches the real model's without downloading it: every matrix has its real shape, the LM head
included. The demo tokenizer's vocabulary is small, so prompts use only its ids (the engine also
samples only ids below the tokenizer's vocabulary); the special-token ids in the config are the
demo tokenizer's. `overrides` replace config fields (for a quick check at a tiny size).

Invariants: the same preset, overrides and seed give identical files; a folder only ever appears
complete (written under a temporary name and renamed into place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nanoserve.cache import cache_root
from nanoserve.model import demo
from nanoserve.model.checkpoint.weights import expected_shapes
from nanoserve.model.config import ModelConfig
from nanoserve.model.decoder import CausalLM
from nanoserve.model.families import FAMILIES

_COMMON: dict[str, Any] = {"hidden_act": "silu", "attention_dropout": 0.0, "initializer_range": 0.02,
                           "use_cache": True, "torch_dtype": "bfloat16", "bos_token_id": None}
PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-0.6B config.json (596M parameters).
    "qwen3-0.6b": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                   "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "max_window_layers": 28, "rms_norm_eps": 1e-6,
                   "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
                   "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True},
    # meta-llama/Llama-3.2-1B config.json (1.24B parameters).
    "llama-3.2-1b": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                     "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
                     "tie_word_embeddings": True},
    # google/gemma-3-270m config.json (268M parameters, 170M of them the embedding).
    "gemma-3-270m": {**_COMMON, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                     "hidden_act": None, "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262144,
                     "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                     "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                     "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
                     "layer_types": [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                                     for i in range(18)],
                     "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
                     "attn_logit_softcapping": None, "attention_bias": False, "tie_word_embeddings": True},
}
# The same widths with other layers: a Llama and an OLMo 2 decoder of Gemma-3-270M's size, so that
# a family's layers are compared at equal bytes per token.
PRESETS["llama-as-gemma-3-270m"] = {
    **{k: v for k, v in PRESETS["gemma-3-270m"].items()
       if k not in ("hidden_activation", "rope_local_base_freq", "sliding_window", "layer_types",
                    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping")},
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
PRESETS["olmo2-as-gemma-3-270m"] = {**PRESETS["llama-as-gemma-3-270m"], "architectures": ["Olmo2ForCausalLM"],
                                    "model_type": "olmo2"}
# Qwen/Qwen3-30B-A3B config.json (30.5B parameters, 3.3B active: 128 experts of width 768, 8 per
# token, every layer MoE); benchmarks scale it to the machine with `num_hidden_layers` overridden.
PRESETS["qwen3-30b-a3b"] = {
    **_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40960, "max_window_layers": 48, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    "tie_word_embeddings": False}
FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def shape_config(name: str, overrides: dict[str, Any] | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    """The preset's config.json with `overrides` applied (and the tokenizer's EOS id)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(PRESETS)}")
    config = {**PRESETS[name], **(overrides or {})}
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    ModelConfig.from_hf_dict(config)  # fails early on an override the decoder cannot run
    return config


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings to a dict; values are JSON (numbers, true/false, null) or plain strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--shape-override needs KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def random_weights(config: dict[str, Any], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, bf16 tensor) for every parameter of the config, in checkpoint order, named as its
    family declares them: matrices and biases normal, norms whose effective weight is 1 (1 less the
    family's norm offset, as Gemma stores them)."""
    cfg = ModelConfig.from_hf_dict(config)
    family = FAMILIES[cfg.family]
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    with torch.device("meta"):
        model = CausalLM(cfg, torch.bfloat16)
    for name, shape in expected_shapes(model, family).items():
        if name.endswith("norm.weight"):
            yield name, torch.full(shape, 1.0 - family.layer.norm_offset, dtype=torch.bfloat16)
        else:
            yield name, (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def shape_checkpoint(name: str, overrides: dict[str, Any] | None = None, seed: int = 0,
                     cache_dir: Path | None = None, tokenizer_dir: Path | None = None) -> Path:
    """The cached folder of preset `name` (with `overrides`), written on first use. The tokenizer
    files come from `tokenizer_dir` (default: the demo model's folder)."""
    if tokenizer_dir is None:
        tokenizer_dir = demo.demo_model_path()
    tok_cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    eos = next((int(i) for i, t in tok_cfg.get("added_tokens_decoder", {}).items()
                if t["content"] == tok_cfg.get("eos_token")), None)
    config = shape_config(name, overrides, eos)
    digest = hashlib.sha256(json.dumps([config, seed, FORMAT_VERSION], sort_keys=True).encode())
    for f in _TOKENIZER_FILES:
        digest.update((tokenizer_dir / f).read_bytes())
    if cache_dir is None:
        cache_dir = cache_root()
    path = Path(cache_dir) / f"shape-{name}-{digest.hexdigest()[:12]}"
    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for f in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / f, tmp / f)
        save_file(dict(random_weights(config, seed)), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.chmod(0o755)
        with contextlib.suppress(OSError):  # another process finished first: keep its copy
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
