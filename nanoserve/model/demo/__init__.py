"""The built-in demo checkpoint: a tiny trained Qwen3 model with a byte-level BPE tokenizer.

`demo_model_path()` returns an ordinary Hugging Face folder (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, model.safetensors) that every loader in nanoserve, and
`transformers`, reads like a real checkpoint; `demo_draft_path()` returns the same for its 2-layer
draft (for speculative decoding). They are built on first use and cached; nothing is downloaded.
The tokenizer is trained here from the corpus shipped with the package; the weights are the ones
`scripts/train_demo.py` trained on that corpus and shipped in `weights/` beside this module (see docs/demo_model.md).

Invariants:
- The recipe is deterministic: the same corpus, shipped weights and FORMAT_VERSION give a
  byte-identical tokenizer.json and identical weights.
- The tokenizer built here is byte-identical to the one the weights were trained with: the sha256
  of its tokenizer.json is recorded in weights/train_log.json and checked at build time.
- Special tokens come first in the vocabulary, in SPECIAL_TOKENS order (BpeTrainer places them
  there), so their ids are the indices below and do not depend on training.
- A checkpoint folder only ever appears complete: it is written under a temporary name in the same
  directory and renamed into place. The tokenizer follows Qwen2's layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

from nanoserve.cache import cache_root
from nanoserve.model.config import ModelLoadError

log = logging.getLogger(__name__)

DEMO_VOCAB_SIZE = 4096
# Bump when anything in the recipe below changes without changing the corpus, configs or weights.
FORMAT_VERSION = 3
CORPUS_PATH = Path(__file__).with_name("corpus.txt")
WEIGHTS_DIR = Path(__file__).with_name("weights")
TARGET_WEIGHTS_PATH, DRAFT_WEIGHTS_PATH = WEIGHTS_DIR / "model.safetensors", WEIGHTS_DIR / "draft.safetensors"
TRAIN_LOG_PATH = WEIGHTS_DIR / "train_log.json"

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
END_OF_TEXT_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# The pre-tokenizer split of Qwen2 checkpoints (llama.cpp calls it "qwen2").
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# ChatML. Content may be a string, a list of {"type": "text", "text": ...} parts, or null.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is iterable %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_demo_tokenizer(vocab_size: int = DEMO_VOCAB_SIZE) -> tokenizers.Tokenizer:
    """Trains the demo byte-level BPE on the shipped corpus; deterministic for a given corpus.

    Layout as in Qwen2 checkpoints: no normalizer, Split(Qwen2 regex, isolated) then ByteLevel
    without prefix space or regex, ByteLevel decoder; every byte is in the initial alphabet, so any
    UTF-8 text round-trips. Special tokens are split out of the corpus before training so that no
    merge learns their pieces.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_segments(CORPUS_PATH.read_text(encoding="utf-8")), trainer=trainer)
    return tok


def _training_segments(corpus: str) -> list[str]:
    """The corpus cut at every special token, with the special tokens themselves dropped."""
    segments = [corpus]
    for special in SPECIAL_TOKENS:
        segments = [piece for seg in segments for piece in seg.split(special)]
    return [seg for seg in segments if seg]


def demo_config_dict(vocab_size: int) -> dict[str, Any]:
    """The demo model's `config.json`: a small Qwen3ForCausalLM with tied embeddings."""
    return _qwen3_config(vocab_size, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                         num_kv_heads=2)


def demo_draft_config_dict(vocab_size: int) -> dict[str, Any]:
    """The draft's `config.json`: two layers of half the demo model's width (2 query and 1 KV head),
    same vocabulary and head size. Its weights are a fifth of the target's, so a draft pass costs
    little next to a target step (docs/speculative.md)."""
    return _qwen3_config(vocab_size, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2,
                         num_kv_heads=1)


def _qwen3_config(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                  num_kv_heads: int) -> dict[str, Any]:
    """A Qwen3ForCausalLM config with head_dim 64, tied embeddings and ChatML's special tokens."""
    rope_theta = 1_000_000.0
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": num_layers,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": END_OF_TEXT_ID,
        "torch_dtype": "bfloat16",
    }


def _tokenizer_config() -> dict[str, Any]:
    """`tokenizer_config.json` for PreTrainedTokenizerFast with ChatML."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def tokenizer_sha256(tok: tokenizers.Tokenizer) -> str:
    """sha256 of the exact tokenizer.json bytes that the checkpoint folders hold for `tok`."""
    return hashlib.sha256(_tokenizer_json(tok)).hexdigest()


def _tokenizer_json(tok: tokenizers.Tokenizer) -> bytes:
    return tok.to_str(pretty=True).encode("utf-8")


def _checked_tokenizer() -> tokenizers.Tokenizer:
    """The demo tokenizer, built from the corpus and checked against the one the shipped weights were
    trained with (its sha256 is in train_log.json). Raises ModelLoadError with the remedy if not."""
    tok = train_demo_tokenizer()
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(special) == i, f"{special} must have id {i}"
    try:
        trained = json.loads(TRAIN_LOG_PATH.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"the demo weights' {TRAIN_LOG_PATH.name} is missing from {WEIGHTS_DIR}; "
                             "run `python scripts/train_demo.py` to train them") from None
    built = tokenizer_sha256(tok)
    if built != trained["tokenizer_sha256"]:
        raise ModelLoadError(
            f"the demo tokenizer built from {CORPUS_PATH.name} (sha256 {built[:12]}, tokenizers "
            f"{tokenizers.__version__}) is not the one the shipped demo weights were trained with (sha256 "
            f"{trained['tokenizer_sha256'][:12]}, tokenizers {trained['versions']['tokenizers']}); install that "
            "tokenizers version or retrain with `python scripts/train_demo.py`")
    return tok


def write_demo_checkpoint(path: Path, draft: bool = False) -> Path:
    """Builds the demo checkpoint (or, with `draft`, its 2-layer draft) at `path` and returns it.

    Everything is written to a temporary sibling directory that is then renamed to `path`, so `path`
    is either absent, empty, or complete. Raises FileExistsError (and leaves `path` alone) if
    `path` is already a non-empty directory, e.g. because another process won the race, and
    ModelLoadError if the shipped weights are missing or were trained with another tokenizer.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = _checked_tokenizer()
    weights = DRAFT_WEIGHTS_PATH if draft else TARGET_WEIGHTS_PATH
    make_config = demo_draft_config_dict if draft else demo_config_dict
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / "tokenizer.json").write_bytes(_tokenizer_json(tok))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        _write_json(tmp / "config.json", make_config(tok.get_vocab_size(with_added_tokens=True)))
        generation = {"bos_token_id": None, "eos_token_id": [IM_END_ID, END_OF_TEXT_ID],
                      "pad_token_id": END_OF_TEXT_ID}
        _write_json(tmp / "generation_config.json", generation)
        shutil.copyfile(weights, tmp / "model.safetensors")
        for file in tmp.iterdir():
            file.chmod(0o644)
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary, shareable folder
        try:
            os.replace(tmp, path)
        except OSError as exc:
            if path.is_dir():
                raise FileExistsError(f"{path} already exists and is not empty") from exc
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def demo_model_path(cache_dir: Path | None = None) -> Path:
    """The cached demo checkpoint folder, built on first use.

    `cache_dir` defaults to $NANOSERVE_CACHE, else ~/.cache/nanoserve. The folder name carries a
    hash of the corpus, the config, the shipped weights and FORMAT_VERSION, so a changed recipe is
    built afresh beside the old one. Safe when several processes race: the loser discards its copy
    and uses the winner's.
    """
    return _cached_checkpoint(cache_dir, draft=False)


def demo_draft_path(cache_dir: Path | None = None) -> Path:
    """The cached folder of the demo model's 2-layer draft (for speculative decoding), built on first
    use; same tokenizer files as `demo_model_path()`, otherwise as described there."""
    return _cached_checkpoint(cache_dir, draft=True)


def _cached_checkpoint(cache_dir: Path | None, draft: bool) -> Path:
    if cache_dir is None:
        cache_dir = cache_root()
    kind = "demo-draft-qwen3" if draft else "demo-qwen3"
    path = Path(cache_dir) / f"{kind}-{_recipe_hash(draft)}"
    if path.is_dir():
        return path
    log.info("building the %s model at %s (first use)", kind, path)
    with contextlib.suppress(FileExistsError):  # another process built it first
        write_demo_checkpoint(path, draft=draft)
    return path


def _recipe_hash(draft: bool) -> str:
    """Short hash of everything that determines a demo checkpoint's content."""
    digest = hashlib.sha256()
    digest.update(CORPUS_PATH.read_bytes())
    digest.update((DRAFT_WEIGHTS_PATH if draft else TARGET_WEIGHTS_PATH).read_bytes())
    make_config = demo_draft_config_dict if draft else demo_config_dict
    recipe = {"config": make_config(DEMO_VOCAB_SIZE), "format": FORMAT_VERSION, "tokenizers": tokenizers.__version__}
    digest.update(json.dumps(recipe, sort_keys=True).encode())
    return digest.hexdigest()[:12]


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
