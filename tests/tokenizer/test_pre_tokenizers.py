"""The pre-tokenizer table on its own: every rule compiles in `tokenizers`' regex engine and loses no
text, and the rules llama.cpp splits in code (or with `std::regex` meanings) split as it does.
(That each rule's regexes are llama.cpp's, and that the vocabularies with test vectors give its
ids, is tests/model/test_llama_cpp_vocab.py, which needs llama.cpp's source.)"""

from __future__ import annotations

import pytest
from tokenizers import decoders

from nanoserve.tokenizer.pre_tokenizers import PRE_TOKENIZERS, canonical_name

TEXT = "Hello World! I'm 1234567 ÉCOLE école 中文字 ١٢٣٤ x\u3000y  \n\n\t end  "


def _pieces(name: str, text: str) -> list[str]:
    """The pieces of `text` under rule `name`, mapped back from GPT-2's byte characters."""
    byte_level = decoders.ByteLevel()
    return [byte_level.decode([p]) for p, _ in PRE_TOKENIZERS[name].pre_tokenizer().pre_tokenize_str(text)]


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_rule_compiles_and_keeps_every_character(name):
    pieces = _pieces(name, TEXT)
    assert "".join(pieces) == TEXT and all(pieces)


@pytest.mark.parametrize("name", ["afmoe", "tiny_aya"])
def test_digit_runs_cut_in_threes_from_the_right(name):
    """llama.cpp's hand-written digit split of these rules (its regex for tiny_aya, with `\\b`, would
    keep 1234 in "1234x" whole)."""
    digits = [p for p in _pieces(name, "1234567 1234x 12") if p.strip().isdigit()]
    assert digits == ["1", "234", "567", "1", "234", "12"]


def test_superbpe_groups_ascii_digits_only():
    """Its second regex runs in `std::regex` without Unicode classes, where `\\d` is 0-9."""
    assert _pieces("superbpe", "12345") == ["12", "345"]
    assert _pieces("superbpe", "١٢٣٤٥") == ["١٢٣٤٥"]


def test_deepseek_llm_trailing_spaces_end_the_piece():
    """`\\s+$` in `std::regex` matches at the end of the piece only (Oniguruma's `$` ends any line)."""
    assert _pieces("deepseek-llm", "ab  ")[-1] == "  "
    assert _pieces("deepseek-llm", "a  b")[-2:] == [" ", " b"]


def test_kimi_k2_takes_han_out_of_letters():
    """llama.cpp's "\\p{Han}+" for kimi-k2 only triggers its hand-written split of K2's whole rule."""
    assert _pieces("kimi-k2", "abc中文def") == ["abc", "中文", "def"]
    assert _pieces("kimi-k2", "abc中文 def's 12345") == ["abc", "中文", " def's", " ", "123", "45"]


def test_canonical_names_are_llama_cpps_first_names():
    for name, rule in PRE_TOKENIZERS.items():
        assert PRE_TOKENIZERS[canonical_name(rule)] == rule, name
    assert canonical_name(PRE_TOKENIZERS["gpt2"]) == "gpt-2"
    assert canonical_name(PRE_TOKENIZERS["llama3"]) == "llama-bpe"
    assert PRE_TOKENIZERS["chatglm-bpe"].has_bos is False and PRE_TOKENIZERS["tekken"].add_bos
