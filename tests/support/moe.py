"""Helpers for the mixture-of-experts tests (no tests here): a tiny random checkpoint written with
transformers' own classes and the demo tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch


def save_tiny_moe(path: Path, demo_dir: Path, prefix: str, fields: dict[str, Any]) -> Path:
    """A 2-layer, 64-wide `{prefix}ForCausalLM` (e.g. "Qwen3Moe") with `fields` on top of its
    config, every parameter drawn from N(0, 0.2) under seed 7, saved to `path` with the demo
    tokenizer; returns `path`."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    cfg = getattr(transformers, f"{prefix}Config")(**{
        "vocab_size": len(tok), "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": None, "pad_token_id": None,
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"), **fields})
    torch.manual_seed(7)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / file, path / file)
    return path
