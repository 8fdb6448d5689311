"""The built-in demo checkpoint and its draft: deterministic, trained, loadable, byte-complete, cached."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import tokenizers
import torch
from safetensors.torch import load_file

from nanoserve import LLM, SamplingParams
from nanoserve.model import ModelLoadError, load_model
from nanoserve.model import demo as demo_module
from nanoserve.model.config import ModelConfig
from nanoserve.model.demo import (
    CORPUS_PATH,
    DRAFT_WEIGHTS_PATH,
    IM_END_ID,
    SPECIAL_TOKENS,
    TARGET_WEIGHTS_PATH,
    TRAIN_LOG_PATH,
    demo_draft_path,
    demo_model_path,
    write_demo_checkpoint,
)

from support.forward import full_logits

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
CHECKPOINT_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors"}
# Questions in the corpus's style (not necessarily verbatim in it).
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What colour is grass?",
             "Who are you?")
# Measured 0.87 on the shipped weights (docs/demo_model.md); a pair of untrained models agrees far less.
MIN_DRAFT_AGREEMENT = 0.6
HELD_OUT_TOKENS = 1024


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def draft_dir(demo_dir: Path) -> Path:
    return demo_draft_path(demo_dir.parent)


@pytest.fixture(scope="module")
def train_log() -> dict:
    return json.loads(TRAIN_LOG_PATH.read_text(encoding="utf-8"))


def test_two_builds_are_identical(demo_dir: Path, tmp_path: Path) -> None:
    other = write_demo_checkpoint(tmp_path / "again")
    for name in CHECKPOINT_FILES:
        assert (other / name).read_bytes() == (demo_dir / name).read_bytes(), name


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
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert sum(t.numel() for t in weights.values()) == cfg.num_params
    # trained, not freshly initialised: norms moved away from ones
    assert not torch.equal(weights["model.norm.weight"], torch.ones(cfg.hidden_size, dtype=torch.bfloat16))
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END_ID, tok.token_to_id("<|endoftext|>")]


def test_weights_were_trained_with_this_tokenizer(demo_dir: Path, train_log: dict) -> None:
    assert hashlib.sha256((demo_dir / "tokenizer.json").read_bytes()).hexdigest() == train_log["tokenizer_sha256"]
    assert hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest() == train_log["corpus_sha256"]
    assert (demo_dir / "model.safetensors").read_bytes() == TARGET_WEIGHTS_PATH.read_bytes()


def test_shipped_weights_are_small() -> None:
    assert TARGET_WEIGHTS_PATH.stat().st_size + DRAFT_WEIGHTS_PATH.stat().st_size < 20_000_000


def test_tokenizer_mismatch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             train_log: dict) -> None:
    stale = tmp_path / "train_log.json"
    stale.write_text(json.dumps({**train_log, "tokenizer_sha256": "0" * 64}))
    monkeypatch.setattr(demo_module, "TRAIN_LOG_PATH", stale)
    with pytest.raises(ModelLoadError, match="not the one the shipped demo weights were trained with"):
        write_demo_checkpoint(tmp_path / "demo")
    assert not (tmp_path / "demo").exists()


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


@pytest.mark.parametrize("which", ["model", "draft"])
def test_transformers_loads_model(demo_dir: Path, draft_dir: Path, transformers, which: str) -> None:
    path = demo_dir if which == "model" else draft_dir
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_draft_folder(demo_dir: Path, draft_dir: Path) -> None:
    assert {p.name for p in draft_dir.iterdir()} == CHECKPOINT_FILES and draft_dir != demo_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (draft_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name
    target = load_model(demo_dir, dtype="float32").config
    draft = load_model(draft_dir, dtype="float32").config
    assert draft.num_hidden_layers == 2 < target.num_hidden_layers
    assert draft.vocab_size == target.vocab_size and draft.hidden_size <= target.hidden_size
    assert (draft_dir / "model.safetensors").read_bytes() == DRAFT_WEIGHTS_PATH.read_bytes()


def _corpus_words() -> set[str]:
    return set(re.findall(r"[A-Za-z]+", CORPUS_PATH.read_text(encoding="utf-8")))


def test_chat_answers_in_sentences(demo_dir: Path) -> None:
    """Greedy answers through the engine are sentences of corpus words that end their turn; random
    weights produce token soup that runs to max_tokens. (Whether the facts are right is not asked:
    a 4M-parameter model trained for minutes gets some wrong, see docs/demo_model.md.)"""
    llm = LLM(str(demo_dir), max_model_len=256)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=64))
    vocabulary = _corpus_words()
    for question, out in zip(QUESTIONS, outs, strict=True):
        answer = out.outputs[0]
        words = re.findall(r"[A-Za-z]+", answer.text)
        assert answer.finish_reason == "stop", (question, answer.text)
        assert len(words) >= 3 and sum(w in vocabulary for w in words) >= 0.9 * len(words), (question, answer.text)
        assert answer.text.rstrip().endswith((".", "!", "?")), (question, answer.text)


def test_draft_agrees_with_target_on_held_out_text(demo_dir: Path, draft_dir: Path, train_log: dict) -> None:
    target, draft = load_model(demo_dir, dtype="float32"), load_model(draft_dir, dtype="float32")
    held_out = CORPUS_PATH.read_text(encoding="utf-8")[train_log["held_out_from_char"]:]
    ids = target.tokenizer.encode(held_out)[:HELD_OUT_TOKENS]
    assert len(ids) == HELD_OUT_TOKENS
    with torch.no_grad():
        target_next = full_logits(target, [ids])[0].argmax(-1)
        draft_next = full_logits(draft, [ids])[0].argmax(-1)
    agreement = (target_next == draft_next).float().mean().item()
    assert agreement > MIN_DRAFT_AGREEMENT
    assert (target_next[:-1] == torch.tensor(ids[1:])).float().mean().item() > 0.5  # the target predicts text


def test_folder_name_covers_the_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = demo_model_path(tmp_path / "cache").name
    altered = tmp_path / "model.safetensors"
    shutil.copyfile(TARGET_WEIGHTS_PATH, altered)
    with altered.open("ab") as f:
        f.write(b" ")
    monkeypatch.setattr(demo_module, "TARGET_WEIGHTS_PATH", altered)
    assert demo_model_path(tmp_path / "cache").name != before


def test_demo_model_path_reuses_folder(tmp_path: Path) -> None:
    first = demo_model_path(tmp_path)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert set(mtimes) == CHECKPOINT_FILES
    second = demo_model_path(tmp_path)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in second.iterdir()} == mtimes
    assert list(tmp_path.iterdir()) == [first]  # no temporary folders left behind


def test_demo_model_path_default_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "cache"))
    path = demo_model_path()
    assert path.parent == tmp_path / "cache" and (path / "model.safetensors").is_file()
    assert demo_draft_path().parent == tmp_path / "cache"


def test_write_refuses_existing_folder(demo_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        write_demo_checkpoint(target)
    assert (target / "config.json").read_text() == "{}"
    assert list(tmp_path.iterdir()) == [target]
