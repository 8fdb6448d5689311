"""llama.cpp's pre-tokenizers: how a GGUF vocabulary's `tokenizer.ggml.pre` splits text before BPE.

llama.cpp (`src/llama-vocab.cpp`) maps each `tokenizer.ggml.pre` name of a byte-level BPE vocabulary
to a pre-tokenizer type, and each type to a list of regexes applied in turn: every regex splits every
piece the previous ones left, its matches and the text between them alike becoming pieces (what a
`tokenizers` `Split` with behaviour "isolated" does), and each piece is then BPE-encoded on its own.
`PRE_TOKENIZERS` holds, per name, those regexes and the defaults the name sets there.

Invariants:
- Every name llama.cpp's loader accepts for a byte-level BPE vocabulary is a key, and its
  `splits` are llama.cpp's regex strings for that name's type, character for character (the
  tests read them from llama.cpp's source), as are its `ignore_merges`, `add_bos` and `has_bos`.
  One more key, "gpt2", is nanoserve's own: files it wrote before it wrote "gpt-2".
- What runs is `run_as(regex)`: the same string, except where llama.cpp does not run its string
  with `std::regex`. For those it splits with hand-written code, which `RUN_AS` replaces by a regex
  that splits the same way in `tokenizers`' engine (Oniguruma): the tokenizer.json originals of
  the GPT-2, Llama 3, Qwen2 and Qwen3.5 rules (llama.cpp's code reproduces them), Kimi K2's
  original (Han taken out of letters by class intersection), and digit runs cut in threes from
  the right (afmoe, tiny_aya). Two `std::regex` meanings are spelt out: `\\d` without Unicode
  classes is ASCII only (`[0-9]`), and `$` is the end of the piece (`\\z`).
- Several names share one rule (a value of `PreTokenizer`); `canonical_name` is the first name
  listed for it, the one a GGUF writer stores.
- llama.cpp's types that split without GPT-2's byte encoding (`NOT_BYTE_LEVEL`: Gemma 4, Sarvam,
  whitespace) are not byte-level BPE vocabularies; they are not keys (a Gemma 4 file names its own
  tokenizer model, "gemma4", read by `sentencepiece_bpe.build_from_merges`).
"""

# ruff: noqa: E501  (each of llama.cpp's regexes is one literal, as in its source, to be read against it)

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from tokenizers import Regex, models, pre_tokenizers

# Rules llama.cpp runs as hand-written code, each as the tokenizer.json regex it reproduces.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KIMI_K2_REGEX = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DIGITS_BY_THREE = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"  # 1234567 -> 1, 234, 567

# llama.cpp's regex strings (C++ escapes undone; \u: code points that Unicode normalization rewrites).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_AFMOE_DIGITS = r"\p{AFMoE_digits}"
_TINY_AYA_DIGITS = r"\d{1,3}(?=(?:\d{3})*\b)"
_KIMI_K2 = r"\p{Han}+"
_DEEPSEEK_END_SPACE = r"\s+$"
_SUPERBPE_THREES = r"(?=(\d{3})+(?!\d))"

RUN_AS: Mapping[str, str] = MappingProxyType({
    _GPT2: GPT2_REGEX,
    _LLAMA3: LLAMA3_REGEX,
    _QWEN2: QWEN2_REGEX,
    _QWEN35: QWEN35_REGEX,
    _KIMI_K2: KIMI_K2_REGEX,
    _AFMOE_DIGITS: DIGITS_BY_THREE,
    _TINY_AYA_DIGITS: DIGITS_BY_THREE,
    _DEEPSEEK_END_SPACE: r"\s+\z",
    _SUPERBPE_THREES: r"(?=([0-9]{3})+(?![0-9]))",
})


def run_as(regex: str) -> str:
    """The regex `tokenizers` runs for llama.cpp's `regex` (see the module docstring)."""
    return RUN_AS.get(regex, regex)


class PreTokenizer(NamedTuple):
    """How llama.cpp splits text for one `tokenizer.ggml.pre` value, and its defaults there."""

    splits: tuple[str, ...]  # llama.cpp's regexes, applied in order to every piece; gaps are pieces
    ignore_merges: bool = False  # a word found whole in the vocabulary is one token (no BPE)
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token
    has_bos: bool = True  # False: llama.cpp sets no BOS token whatever the file says

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        """The `tokenizers` pre-tokenizer: the splits, then GPT-2's bytes-to-characters map."""
        steps = [pre_tokenizers.Split(Regex(run_as(r)), behavior="isolated", invert=False) for r in self.splits]
        return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def model(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> models.BPE:
        """The BPE model of a byte-level vocabulary, merging as llama.cpp does for this rule."""
        return models.BPE(vocab=vocab, merges=merges, ignore_merges=self.ignore_merges)


_DIGIT = r"\p{N}"
_CJK_DEEPSEEK = "[一-龥ࠀ-一가-\ud7ff]+"
_CJK_DEEPSEEK3 = "[一-龥\u3040-ゟ゠-ヿ]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", _CJK_DEEPSEEK3, "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CHATGLM4 = PreTokenizer((_LLAMA3,), has_bos=False)

# (names, rule): the names of one llama.cpp type, in llama.cpp's order but the canonical one first.
_TABLE: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     PreTokenizer((_QWEN2,))),
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
      "granite-docling", "gpt2"), PreTokenizer((_GPT2,))),
    (("default",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    (("minicpm5",), PreTokenizer((r"\p{N}{1,3}", r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
    (("deepseek-llm",), PreTokenizer((
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        _DEEPSEEK_END_SPACE, _CJK_DEEPSEEK, r"\p{N}+",
    ))),
    (("deepseek-coder",), PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_DEEPSEEK, _DIGIT))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizer(_DEEPSEEK3)),
    (("spark2_5",), PreTokenizer((*_DEEPSEEK3[:2], "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", _DIGIT))),
    (("youtu",), PreTokenizer(("[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+", r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizer((_DIGIT, _GPT2))),
    (("jais-2",), PreTokenizer((r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",))),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    (("chatglm-bpe",), _CHATGLM4),
    (("glm4", "glm5"), _CHATGLM4._replace(ignore_merges=True)),
    (("viking",), PreTokenizer((_BLOOM, _DIGIT))),
    (("tekken",), PreTokenizer((r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True, add_bos=True)),
    (("chameleon",), PreTokenizer((
        "<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", _DIGIT,
        r"[\p{P}!-/:-@\[-`{-~]", _GPT2,
    ), add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("granite-embed-multi-97m",), PreTokenizer((r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True)),
    (("tiny_aya", "cohere2moe"), PreTokenizer((_TINY_AYA_DIGITS, r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"))),
    (("kimi-k2",), PreTokenizer((_KIMI_K2,))),
    (("superbpe",), PreTokenizer((r"\p{N}+", _SUPERBPE_THREES))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",))),
    (("seed-coder",), PreTokenizer((r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("ufakzeka",), PreTokenizer((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("grok-2",), PreTokenizer((_QWEN2,))),
    (("afmoe",), PreTokenizer((_AFMOE_DIGITS, "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+", "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"))),
    (("laguna",), PreTokenizer((r"[^\n]+|[\n]+", _QWEN2))),
    (("exaone-moe",), PreTokenizer((r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",))),
)

PRE_TOKENIZERS: Mapping[str, PreTokenizer] = MappingProxyType(
    {name: rule for names, rule in _TABLE for name in names}
)
# llama.cpp's names of BPE vocabularies split without GPT-2's byte encoding (not byte-level BPE).
NOT_BYTE_LEVEL = frozenset({"gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace"})


def canonical_name(rule: PreTokenizer) -> str:
    """The first name listed for `rule`: the one a GGUF writer stores."""
    return next(names[0] for names, known in _TABLE if known == rule)
