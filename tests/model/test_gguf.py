"""GGUF: files written by our exporter load to the same config, logits and tokenizer as the
safetensors checkpoint they came from; unsupported files fail with a message that names why."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file

from nanoserve.model import LoadedModel, ModelConfig, UnsupportedModelError, load_model
from nanoserve.model.checkpoint import gguf_reader
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.checkpoint.gguf_reader import (
    ROPE_SCALING_KEY,
    fit_llama3_scaling,
    llama3_rope_factors,
    read_gguf,
)
from nanoserve.model.config import ModelLoadError, RopeScaling
from nanoserve.model.families import FAMILIES as REGISTRY
from nanoserve.model.families.llama import LLAMA
from nanoserve.tokenizer.pre_tokenizers import LLAMA3_REGEX

from support.families import FAMILIES
from support.forward import full_logits

LENGTHS = (1, 5, 23, 64)
# Max abs logit difference from the fp32 safetensors model. Measured on the conftest models (random
# weights, initializer_range 0.1, logits within about +-3.7), worst family: F32 0 (exact), F16 4.5e-3,
# BF16 4.2e-2, Q8_0 0.126. The bounds leave 2-3x margin.
TOLERANCE = {"F32": 1e-5, "F16": 1.5e-2, "BF16": 0.1, "Q8_0": 0.3}
TEXTS = (
    "Hello, world! It's a test; don't PANIC'LL ok?",
    "  leading spaces\n\n\ttabs and\r\nwindows lines   \n",
    "numbers 1234567890 3.14159 1,000,000",
    "Grüße aus Köln, naïve café — ça va? ñandú",
    "日本語のテキストと中文文本，还有한국어。",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "e\u0301 (combining), \u00e9 (precomposed), zero\u200bwidth",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|>x<|im_start|><|im_",
    "code: def f(x):\n    return x ** 2  # ok\n",
    "",
)


@pytest.fixture(scope="module")
def exported(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, Path]]:
    """(family, out_type, **config overrides) -> (safetensors folder, GGUF file), built once each."""
    cache: dict[str, tuple[Path, Path]] = {}

    def export(family: str, out_type: str = "F32", **overrides: Any) -> tuple[Path, Path]:
        key = f"{family}-{out_type}-{sorted(overrides.items())!r}"
        if key not in cache:
            src = make_checkpoint(family, **overrides)
            cache[key] = src, export_gguf(src, tmp_path_factory.mktemp("gguf") / f"{family}.gguf", out_type)
        return cache[key]

    return export


@pytest.fixture(scope="module")
def reference() -> Callable[[Path], tuple[LoadedModel, list[torch.Tensor]]]:
    """safetensors folder -> (fp32 model, its logits on `_seqs`), computed once per folder."""
    cache: dict[Path, tuple[LoadedModel, list[torch.Tensor]]] = {}

    def load(src: Path) -> tuple[LoadedModel, list[torch.Tensor]]:
        if src not in cache:
            loaded = load_model(src, dtype=torch.float32)
            cache[src] = loaded, full_logits(loaded, _seqs(loaded.config.vocab_size))
        return cache[src]

    return load


def _seqs(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


def _max_logit_diff(ref_logits: list[torch.Tensor], loaded: LoadedModel) -> float:
    got = full_logits(loaded, _seqs(loaded.config.vocab_size))
    return max((x - y).abs().max().item() for x, y in zip(ref_logits, got, strict=True))


def _as_gguf_sees_it(cfg: ModelConfig) -> ModelConfig:
    """GGUF has no Mistral architecture: llama.cpp's converter writes Mistral as `llama`."""
    return dataclasses.replace(cfg, family="llama") if cfg.family == "mistral" else cfg


def _rewrite(src: Path, dst: Path, arch: str | None = None, drop: tuple[str, ...] = (),
             strings: dict[str, str] | None = None, matrices_as: QType | None = None) -> Path:
    """A copy of a GGUF file with another architecture name, some keys dropped, strings set, or
    its F32 matrices requantized."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    strings = strings or {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop or name in strings:
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for key, value in strings.items():
        writer.add_string(key, value)
    for t in reader.tensors:
        if matrices_as is not None and t.tensor_type == QType.F32 and t.data.ndim == 2:
            writer.add_tensor(t.name, gguf.quants.quantize(t.data, matrices_as), raw_dtype=matrices_as)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_round_trip(exported, reference, family):
    src, path = exported(family)
    (ref, ref_logits), got = reference(src), load_model(path, dtype=torch.float32)
    assert got.config == _as_gguf_sees_it(ref.config)
    assert _max_logit_diff(ref_logits, got) < TOLERANCE["F32"]


def test_registered_family_written_as_its_gguf_architecture(make_checkpoint, reference, tmp_path):
    """A family added to a registry value (Llama's declaration under another name, as
    test_model_parity's IQuestCoder) is written under the GGUF architecture it declares (`llama`,
    Q/K rows permuted) and reads back as the first family stored so (Llama), to the same logits as
    the checkpoint."""
    src = make_checkpoint("llama")
    ours = shutil.copytree(src, tmp_path / "iquestcoder")
    cfg = json.loads((ours / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["IQuestCoderForCausalLM"], "iquestcoder"
    (ours / "config.json").write_text(json.dumps(cfg))
    family = dataclasses.replace(LLAMA, name="iquestcoder", architectures=("IQuestCoderForCausalLM",))
    with pytest.raises(UnsupportedModelError, match="IQuestCoderForCausalLM"):
        export_gguf(ours, tmp_path / "refused.gguf")
    path = export_gguf(ours, tmp_path / "iquestcoder.gguf", families=REGISTRY.extended(family))
    assert GGUFReader(path).fields["general.architecture"].contents() == "llama"
    (ref, ref_logits), got = reference(src), load_model(path, dtype=torch.float32)
    assert got.config == ref.config
    assert _max_logit_diff(ref_logits, got) < TOLERANCE["F32"]


def test_linear_rope_scaling_round_trip(exported, reference):
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    src, path = exported("llama", rope_parameters=rope)
    (ref, ref_logits), got = reference(src), load_model(path, dtype=torch.float32)
    assert got.config == ref.config
    assert _max_logit_diff(ref_logits, got) < TOLERANCE["F32"]


def test_other_quant_types_dequantized_at_load(exported, tmp_path, caplog):
    """Types nanoserve does not multiply in blocks (here BF16) go through gguf.quants with one log
    line naming them. Each matrix comes back within BF16's error of the original (relative RMS
    error 2^-9 at most; a wrong layout would give ~1.4)."""
    src, path = exported("llama")
    other = _rewrite(path, tmp_path / "bf16.gguf", matrices_as=QType.BF16)
    with caplog.at_level(logging.INFO, logger="nanoserve.model.checkpoint.gguf_reader"):
        ckpt = read_gguf(other)
    assert [r.message for r in caplog.records] == [
        "bf16.gguf: converting BF16 tensors to the model's dtype at load "
        "(nanoserve multiplies Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q2_K blocks)"
    ]
    assert ckpt.tensor_formats == {}
    original = load_file(src / "model.safetensors")
    for name, w in ckpt.weights(torch.float32):
        assert isinstance(w, torch.Tensor)
        assert (w - original[name]).norm() / original[name].norm() < 0.1, name


def test_llama_files_store_interleaved_rotary_rows(exported):
    """The converter's Q/K permutation is in the file (llama.cpp needs it) and undone on load."""
    src, path = exported("llama")
    hf_q = load_file(src / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    q = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    head_dim = hf_q.shape[0] // 4
    stored = torch.from_numpy(q.data.copy())
    assert torch.equal(stored[1], hf_q[head_dim // 2])  # row 1 of head 0 is the first row of its 2nd half
    assert not torch.equal(stored, hf_q)


@pytest.mark.parametrize("out_type", ["F16", "BF16", "Q8_0"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # permuted Q/K rows; q/k norms and ties
def test_lower_precision_files(exported, reference, family, out_type):
    src, path = exported(family, out_type)
    (ref, ref_logits), got = reference(src), load_model(path, dtype=torch.float32)
    assert got.config == ref.config
    assert _max_logit_diff(ref_logits, got) < TOLERANCE[out_type]
    types = {t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types == {"F32", out_type}  # norms (and other 1-D tensors) stay F32


def test_tokenizer_rebuilt_from_gguf(exported, reference):
    src, path = exported("qwen2")
    ref, got = reference(src)[0].tokenizer, read_gguf(path).tokenizer
    assert got.backend.get_vocab(with_added_tokens=True) == ref.backend.get_vocab(with_added_tokens=True)
    for text in TEXTS:
        ids = ref.encode(text)
        assert got.encode(text) == ids, text
        assert got.decode(ids, skip_special_tokens=False) == text
        assert got.decode(ids) == ref.decode(ids)
    assert (got.bos_token_id, got.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert got.add_bos_token is ref.add_bos_token is False
    assert {i for i in range(got.vocab_size) if got.is_special(i)} == {0, 1, 2}


def test_llama3_pre_tokenizer_round_trip(make_checkpoint, tmp_path):
    """A tokenizer.json with Llama 3's split regex and ignore_merges becomes "llama-bpe" and back."""
    src = shutil.copytree(make_checkpoint("llama"), tmp_path / "llama3-tok")
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_REGEX
    spec["model"]["ignore_merges"] = True
    (src / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    path = export_gguf(src, tmp_path / "llama3-tok.gguf")
    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    ref, got = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json")), read_gguf(path).tokenizer
    for text in TEXTS:
        assert got.encode(text) == ref.encode(text).ids, text


def test_chat_template_and_stop_tokens_carried(exported, reference):
    src, path = exported("qwen3")
    ref, ckpt = reference(src)[0].tokenizer, read_gguf(path)
    assert ckpt.tokenizer.chat_template == ref.chat_template is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    assert ckpt.tokenizer.encode_chat(messages) == ref.encode_chat(messages)
    im_end, end_of_text = ref.backend.token_to_id("<|im_end|>"), ref.backend.token_to_id("<|endoftext|>")
    # eos from the metadata first, then end-of-turn control tokens, as llama.cpp collects them.
    assert ckpt.generation_eos == (im_end, end_of_text)
    assert ckpt.tokenizer.stop_token_ids == {im_end, end_of_text}


def test_llama3_rope_recovered_without_our_metadata(exported, reference, tmp_path):
    """Real llama.cpp files carry only rope_freqs.weight; Llama 3.1's parameters come back exactly."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    src, path = exported("llama", head_dim=64, rope_parameters=rope)
    bare = _rewrite(path, tmp_path / "bare.gguf", drop=(ROPE_SCALING_KEY,))
    (ref, ref_logits), got = reference(src), load_model(bare, dtype=torch.float32)
    assert got.config == ref.config
    assert _max_logit_diff(ref_logits, got) < TOLERANCE["F32"]


@pytest.mark.parametrize(("factor", "old"), [(8.0, 8192), (32.0, 8192), (16.0, 4096)])
def test_fit_llama3_scaling(factor, old):
    scaling = RopeScaling("llama3", factor, 1.0, 4.0, old)
    fitted = fit_llama3_scaling(llama3_rope_factors(128, 500000.0, scaling), 128, 500000.0)
    assert fitted == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": old}


def test_unsupported_architecture_is_named(exported, tmp_path, monkeypatch):
    """Refused from the file's head: the metadata (the vocabulary) is never parsed."""
    _, path = exported("qwen2")
    bad = _rewrite(path, tmp_path / "gpt2.gguf", arch="gpt2")

    def parse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the metadata was parsed before the architecture was refused")

    monkeypatch.setattr(gguf_reader, "_Reader", parse)
    with pytest.raises(UnsupportedModelError, match=r"unsupported GGUF architecture 'gpt2' in gpt2\.gguf"):
        load_model(bad, dtype=torch.float32)


def test_not_a_gguf_file_is_one_clear_line(tmp_path):
    for name, data in (("text.gguf", b"not a model at all\n"), ("empty.gguf", b""), ("tiny.gguf", b"GG")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ModelLoadError, match=rf"^{name}: not a GGUF file \(it starts with b'.*', not b'GGUF'\)$"):
            load_model(tmp_path / name, dtype=torch.float32)
    (tmp_path / "v1.gguf").write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelLoadError, match=r"^v1.gguf: GGUF version 1, which nanoserve does not read"):
        load_model(tmp_path / "v1.gguf", dtype=torch.float32)


def test_truncated_file_names_the_tensor_cut_short(exported, tmp_path):
    _, path = exported("qwen2")
    data = path.read_bytes()
    last = max(GGUFReader(path).tensors, key=lambda t: t.data_offset)
    (tmp_path / "cut.gguf").write_bytes(data[:-1])
    with pytest.raises(ModelLoadError, match=rf"^cut.gguf: truncated: tensor {last.name} ends past the file "
                                             rf"\(at byte {len(data)} of {len(data) - 1}\)$"):
        load_model(tmp_path / "cut.gguf", dtype=torch.float32)
    (tmp_path / "head.gguf").write_bytes(data[:4096])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match=r"^head.gguf: truncated: the metadata ends past the file$"):
        load_model(tmp_path / "head.gguf", dtype=torch.float32)


def test_unknown_tokenizer_model_is_refused_clearly(exported, tmp_path):
    _, path = exported("qwen2")
    bad = _rewrite(path, tmp_path / "wpm.gguf", strings={"tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tokenizer model 'bert'"):
        read_gguf(bad)


@pytest.fixture(scope="module")
def sentencepiece_gguf(exported, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A SentencePiece BPE model (byte fallback, Llama 2's settings) trained on the demo corpus,
    and the llama GGUF file rewritten with it as its vocabulary, as llama.cpp's converter stores one
    (tokens, scores, token types, unk/bos/eos ids)."""
    import io

    import sentencepiece as spm

    lines = (Path(__file__).parents[2] / "nanoserve/model/demo/corpus.txt").read_text(encoding="utf-8").splitlines()
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines[:20000]), model_writer=proto, vocab_size=800, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()

    def kind(i: int) -> gguf.TokenType:
        for test, t in ((sp.is_unknown, gguf.TokenType.UNKNOWN), (sp.is_control, gguf.TokenType.CONTROL),
                        (sp.is_byte, gguf.TokenType.BYTE), (sp.is_unused, gguf.TokenType.UNUSED)):
            if test(i):
                return t
        return gguf.TokenType.NORMAL

    _, src = exported("llama", vocab_size=n)  # the embedding has one row per piece, as in a real file
    reader = GGUFReader(src)
    dst = tmp_path_factory.mktemp("spm") / "llama-spm.gguf"
    writer = GGUFWriter(dst, "llama")
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([kind(i) for i in range(n)])
    writer.add_unk_token_id(sp.unk_id())
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sp, dst


SPM_TEXTS = (*TEXTS, "The capital of France is Paris.", "  x", "a  b   c", " ", "\n", "x\n y")


def test_sentencepiece_tokenizer_from_gguf(sentencepiece_gguf):
    """Encodes as SentencePiece itself does (BOS first, as llama.cpp adds it), decodes back to the
    text; special tokens in the text are parsed, and the text after one gets its own space prefix."""
    sp, path = sentencepiece_gguf
    tok = read_gguf(path).tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (sp.bos_id(), sp.eos_id(), True)
    for text in SPM_TEXTS:
        ids = tok.encode(text)
        assert ids == [sp.bos_id(), *sp.encode(text)], text
        assert tok.decode(ids) == sp.decode(ids[1:]) == text
    assert tok.encode("<s>Hi</s> there", add_special_tokens=False) == [
        sp.bos_id(), *sp.encode("Hi"), sp.eos_id(), *sp.encode(" there")]


def test_sentencepiece_gguf_serves(sentencepiece_gguf):
    """The model loads with its SentencePiece vocabulary and generates text through it."""
    from nanoserve import LLM, SamplingParams

    _, path = sentencepiece_gguf
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 8 and all(0 <= i < 800 for i in ids)
    assert out[0].outputs[0].text == llm.tokenizer.decode(ids)


@pytest.mark.peers
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is in the bench extra")
def test_sentencepiece_tokenizer_matches_llama_cpp(sentencepiece_gguf):
    """llama.cpp tokenizes the same file identically, special tokens in the text included."""
    import llama_cpp

    _, path = sentencepiece_gguf
    tok = read_gguf(path).tokenizer
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in (*SPM_TEXTS, "x<s>Hi</s> there", "a</s>\nb"):  # (a leading <s>: llama.cpp doubles BOS)
        if text:
            assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True), text


def test_byte_level_vocabulary_without_merges_is_refused(exported, tmp_path):
    _, path = exported("qwen2")
    bad = _rewrite(path, tmp_path / "nomerges.gguf", drop=("tokenizer.ggml.merges",))
    with pytest.raises(UnsupportedModelError, match=r"'qwen2'.* without tokenizer\.ggml\.merges"):
        read_gguf(bad)


def test_unknown_pre_tokenizer_is_refused(exported, tmp_path):
    _, path = exported("qwen2")
    bad = _rewrite(path, tmp_path / "pre.gguf", strings={"tokenizer.ggml.pre": "chatglm-bpe-9"})
    with pytest.raises(UnsupportedModelError, match=r"pre-tokenizer 'chatglm-bpe-9' \(unknown\)"):
        read_gguf(bad)
    bad = _rewrite(path, tmp_path / "pre.gguf", strings={"tokenizer.ggml.pre": "gemma4"})
    with pytest.raises(UnsupportedModelError, match=r"'gemma4' \(a vocabulary that is not byte-level BPE\)"):
        read_gguf(bad)
