"""The built-in demo checkpoint: deterministic, loadable by transformers, byte-complete, cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import load_file

from nanoserve.model.config import ModelConfig
from nanoserve.model.demo import (
    IM_END_ID,
    SPECIAL_TOKENS,
    demo_model_path,
    write_demo_checkpoint,
)

MIXED_TEXT = (
    "Hello, world! What is 17 + 25? 17 + 25 = 42.\n\n\tTabs  and   spaces \r\n"
    "café naïve Zürich São Paulo crème brûlée — “quotes” €12\n"
    "你好，世界 日本語 東京 안녕하세요 привет\n"
    "😀 👍🏽 👨‍👩‍👧 🇫🇷 ☀️ \x00\x01\x1f\x7f end"
)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_two_builds_are_identical(demo_dir: Path, tmp_path: Path) -> None:
    other = write_demo_checkpoint(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (other / name).read_bytes() == (demo_dir / name).read_bytes(), name
    first, second = load_file(demo_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, second[name]), name


def test_config_and_weights_agree(demo_dir: Path) -> None:
    cfg_dict = json.loads((demo_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict(cfg_dict)
    tok = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert cfg.family == "qwen3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    assert cfg.eos_token_id == (IM_END_ID,) and cfg.bos_token_id is None
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    weights = load_file(demo_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    assert sum(t.numel() for t in weights.values()) == cfg.num_params
    assert torch.equal(weights["model.norm.weight"], torch.ones(cfg.hidden_size, dtype=torch.bfloat16))
    assert 0.015 < weights["model.embed_tokens.weight"].float().std().item() < 0.025
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, tok.token_to_id("<|endoftext|>")]


def test_every_byte_round_trips(demo_dir: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    vocab = tok.get_vocab()
    assert all(ch in vocab for ch in tokenizers.pre_tokenizers.ByteLevel.alphabet())
    every_ascii = "".join(map(chr, range(128)))
    for text in (MIXED_TEXT, every_ascii, " leading space", "trailing space ", "\n\n\n"):
        assert tok.decode(tok.encode(text).ids) == text


def test_special_tokens_are_single_ids(demo_dir: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|endoftext|>").ids
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in ids and ids[-1] == tok.token_to_id("<|endoftext|>")


def test_transformers_tokenizer_matches(demo_dir: Path, transformers) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    raw = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    samples = (MIXED_TEXT, "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", "The capital of Peru is Lima.")
    for text in samples:
        ids = hf.encode(text)
        assert ids == raw.encode(text).ids
        assert hf.decode(ids) == text
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    assert len(hf) == raw.get_vocab_size(with_added_tokens=True)


def test_chat_template(demo_dir: Path, transformers) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    prompt = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    assert without + "<|im_start|>assistant\n" == prompt
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    assert hf.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == prompt
    answered = [*CONVERSATION, {"role": "assistant", "content": "Paris."}]
    assert hf.apply_chat_template(answered, tokenize=False).endswith(
        "<|im_start|>assistant\nParis.<|im_end|>\n"
    )


def test_transformers_loads_model(demo_dir: Path, transformers) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_demo_model_path_reuses_folder(tmp_path: Path) -> None:
    first = demo_model_path(tmp_path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert set(mtimes) == {"config.json", "generation_config.json", "tokenizer.json",
                           "tokenizer_config.json", "model.safetensors"}
    second = demo_model_path(tmp_path)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == mtimes
    assert list(tmp_path.iterdir()) == [first]  # no temporary folders left behind


def test_demo_model_path_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = demo_model_path()
    assert path.parent == tmp_path / "cache" and (path / "model.safetensors").is_file()


def test_write_refuses_existing_folder(demo_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        write_demo_checkpoint(target)
    assert (target / "config.json").read_text() == "{}"
    assert list(tmp_path.iterdir()) == [target]
