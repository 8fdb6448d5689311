"""nanoserve's GGUF tokenizers judged by llama.cpp's own test vectors and tables.

llama.cpp ships vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`) with test texts (`.inp`)
and the ids llama.cpp must produce for them (`.out`), tokenized as its `test-tokenizer-0` does:
no BOS/EOS added, special tokens in the text not parsed. Every BPE and SentencePiece vocabulary
among them must give those ids through `read_gguf_tokenizer`, and again through `load_model` once
wrapped around tiny random weights. The WordPiece (BERT) vocabularies are for the embeddings
issue.
`pre_tokenizers.PRE_TOKENIZERS` must hold every name llama.cpp's loader reads for a byte-level BPE
vocabulary with the regexes and defaults it gives that name in `llama-vocab.cpp`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType, GGUFWriter

from nanoserve.model import UnsupportedModelError, load_model
from nanoserve.model.checkpoint.gguf_reader import read_gguf, read_gguf_metadata, read_gguf_tokenizer
from nanoserve.tokenizer.pre_tokenizers import NOT_BYTE_LEVEL, PRE_TOKENIZERS, RUN_AS

from support.forward import full_logits
from support.llama_cpp_vocab import pre_tokenizer_table, vendored_llama_cpp, vocab_cases

pytestmark = [pytest.mark.slow, pytest.mark.peers]

# Every vocabulary of the pinned sdist that has test vectors, by how nanoserve treats it.
BPE_AND_SPM = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
               "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
WORDPIECE = ("bert-bge",)
# Wrapped around weights: one per kind of vocabulary or rule (SentencePiece, Gemma 4, ignore_merges,
# several splits, \p{M} in letters).
WRAPPED = ("llama-spm", "gemma-4", "llama-bpe", "deepseek-llm", "falcon", "qwen35")
HIDDEN, FFN, HEADS = 16, 32, 2


@pytest.fixture(scope="module")
def llama_cpp() -> Path:
    return vendored_llama_cpp()


def _vocab(llama_cpp: Path, name: str) -> Path:
    return llama_cpp / "models" / f"ggml-vocab-{name}.gguf"


def test_every_vocabulary_with_vectors_is_accounted_for(llama_cpp):
    with_vectors = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in (llama_cpp / "models").glob("*.gguf.inp")}
    assert with_vectors == {*BPE_AND_SPM, *WORDPIECE}


def test_pre_tokenizer_table_is_llama_cpps(llama_cpp):
    theirs = pre_tokenizer_table(llama_cpp)
    byte_level = {name for name, pre in theirs.items() if pre.byte_encode}
    assert {name for name, pre in theirs.items() if not pre.byte_encode} == NOT_BYTE_LEVEL
    assert set(PRE_TOKENIZERS) == byte_level | {"gpt2"}
    for name in byte_level:
        ours, pre = PRE_TOKENIZERS[name], theirs[name]
        assert ours.splits == pre.regexes, name
        assert (ours.ignore_merges, ours.add_bos, ours.has_bos) == (pre.ignore_merges, pre.add_bos, pre.has_bos), name
    used = {r for pre in theirs.values() for r in pre.regexes}
    assert set(RUN_AS) <= used  # every substitution stands for a regex llama.cpp has


def _assert_llama_cpps_ids(tokenizer, vocab: Path) -> None:
    wrong = [(case.text, case.ids, got) for case in vocab_cases(vocab)
             if (got := tokenizer.encode(case.text, add_special_tokens=False)) != case.ids]
    assert not wrong, f"{vocab.name}: {len(wrong)} texts tokenized otherwise, first: {wrong[0]}"


@pytest.mark.parametrize("name", BPE_AND_SPM)
def test_ids_equal_llama_cpps(llama_cpp, name):
    _assert_llama_cpps_ids(read_gguf_tokenizer(_vocab(llama_cpp, name)), _vocab(llama_cpp, name))


def test_wordpiece_is_refused_by_name(llama_cpp):
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF tokenizer model 'bert'"):
        read_gguf_tokenizer(_vocab(llama_cpp, "bert-bge"))


def _wrap(vocab: Path, dst: Path) -> Path:
    """A one-layer Llama GGUF with random weights around `vocab`'s tokenizer (all its keys)."""
    meta = read_gguf_metadata(vocab)
    n_vocab = len(meta["tokenizer.ggml.tokens"])
    writer = GGUFWriter(dst, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in meta.items():
        if key.startswith("tokenizer."):
            if isinstance(value, list):
                writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=_gguf_type(value[0], in_array=True))
            else:
                writer.add_key_value(key, value, _gguf_type(value))
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (n_vocab, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (head_dim, HIDDEN), "blk.0.attn_v.weight": (head_dim, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _gguf_type(value: object, in_array: bool = False) -> GGUFValueType:
    """The type llama.cpp's converter stores a tokenizer value of this Python type as (token ids
    as UINT32, token types as an INT32 array)."""
    kinds = {bool: GGUFValueType.BOOL, int: GGUFValueType.INT32 if in_array else GGUFValueType.UINT32,
             float: GGUFValueType.FLOAT32, str: GGUFValueType.STRING}
    return kinds[type(value)]


@pytest.mark.parametrize("name", WRAPPED)
def test_wrapped_in_tiny_weights_load_model_tokenizes_as_llama_cpp(llama_cpp, tmp_path, name):
    vocab = _vocab(llama_cpp, name)
    loaded = load_model(_wrap(vocab, tmp_path / f"{name}.gguf"), dtype=torch.float32)
    assert loaded.config.vocab_size == len(read_gguf_metadata(vocab)["tokenizer.ggml.tokens"])
    _assert_llama_cpps_ids(loaded.tokenizer, vocab)
    ids = loaded.tokenizer.encode("Hello world", add_special_tokens=False)
    (logits,) = full_logits(loaded, [ids])
    assert logits.shape == (len(ids), loaded.config.vocab_size) and torch.isfinite(logits).all()


def test_unsupported_architecture_is_refused_before_the_vocabulary_is_parsed(llama_cpp):
    """command-r's vocabulary (256k tokens) under an architecture nanoserve does not serve: the
    refusal reads the file's head only, a small part of the time parsing the vocabulary takes."""
    vocab = _vocab(llama_cpp, "command-r")
    start = time.perf_counter()
    read_gguf_tokenizer(vocab)
    parse = time.perf_counter() - start
    start = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'command-r' in ggml-vocab"):
        read_gguf(vocab)
    refuse = time.perf_counter() - start
    assert refuse < parse / 10, (refuse, parse)
