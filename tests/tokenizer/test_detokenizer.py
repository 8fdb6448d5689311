"""IncrementalDetokenizer: streamed deltas join to the full decode and never split a character."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello world, this is plain ASCII text.",
    "Café naïve résumé — Ünïcödé façade, crème brûlée.",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and math ∑∫√∞.",
    "Mixed: a😀b é日c\n\tnew line  double  spaces ",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = " ".join(TEXTS).split()
    return [" ".join(rng.choices(words, k=12)) for _ in range(300)]


def _byte_level() -> Tokenizer:
    """A small ByteLevel BPE (GPT-2 / Llama-3 / Qwen style); rare characters stay split into bytes."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(_corpus(), trainer)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=None)


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2 / Mistral style tokenizer: "▁" for spaces, byte fallback, first leading space stripped."""
    chars = sorted({c for text in TEXTS for c in text.replace(" ", "") if c.isascii() and c.isprintable()})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *chars]:
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", chat_template=None)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return _byte_level() if request.param == "byte_level" else _sentencepiece_style()


def _stream(
    tok: Tokenizer, ids: Sequence[int], skip: bool = True, prompt: Sequence[int] = ()
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    deltas = [detok.push(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


@pytest.mark.parametrize("text", TEXTS)
def test_encoded_text_streams_exactly_without_replacement_chars(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    deltas, tail = _stream(tokenizer, ids)
    assert "".join(deltas) + tail == full
    assert tail == ""
    emitted = ""
    for delta in deltas:
        assert "\ufffd" not in delta
        emitted += delta
        assert full.startswith(emitted)


def test_multibyte_characters_are_split_over_byte_tokens(tokenizer: Tokenizer) -> None:
    """Guards the premise of the test above: some characters really arrive in pieces."""
    ids = tokenizer.encode("👨‍👩‍👧 🇫🇷", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def _random_ids(tok: Tokenizer, rng: random.Random, units: int) -> list[int]:
    """Random ids, mixed with the (often multi-token) encodings of random multibyte characters.

    Byte-fallback tokens (`<0xNN>`) appear only inside such encodings, i.e. as valid UTF-8 (see
    `test_invalid_byte_fallback_run_keeps_streamed_text` for the other case); ByteLevel tokens,
    which include partial characters, are drawn freely.
    """
    ids: list[int] = []
    for _ in range(units):
        if rng.random() < 0.3:
            ids += tok.encode(rng.choice("éßø中文字日本語한국😀🦄🎉∑√"), add_special_tokens=False)
        else:
            token_id = rng.randrange(tok.vocab_size)
            if not (tok.id_to_token(token_id) or "").startswith("<0x"):
                ids.append(token_id)
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_join_to_full_decode(tokenizer: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        ids = _random_ids(tokenizer, rng, rng.randrange(1, 30))
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        deltas, tail = _stream(tokenizer, ids, skip)
        assert "".join(deltas) + tail == full, ids
        if "\ufffd" not in full:
            assert all("\ufffd" not in d for d in [*deltas, tail]), ids


def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert bos is not None and eos is not None
    ids = [bos, *tokenizer.encode("Hello 😀 world", add_special_tokens=False), eos]
    for skip in (True, False):
        deltas, tail = _stream(tokenizer, ids, skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    skipped, _ = _stream(tokenizer, ids, skip=True)
    kept, _ = _stream(tokenizer, ids, skip=False)
    assert skipped[0] == "" and skipped[-1] == ""
    assert "</s>" not in "".join(skipped)
    assert kept[-1] == "</s>"


def test_sequence_ending_mid_character_is_flushed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🦄", add_special_tokens=False)  # not in the corpus: bytes
    partial = next(ids[:k] for k in range(len(ids), 0, -1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    deltas, tail = _stream(tokenizer, partial)
    assert "\ufffd" not in "".join(deltas)
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tokenizer.decode(partial)


def test_flush_is_empty_when_nothing_is_pending(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.flush() == ""
    for i in tokenizer.encode("Hello world", add_special_tokens=False):
        detok.push(i)
    assert detok.flush() == ""
    assert detok.flush() == ""
    assert detok.text == tokenizer.decode(tokenizer.encode("Hello world", add_special_tokens=False))


def test_prompt_context_keeps_leading_space() -> None:
    """SentencePiece decoders strip the first token's space; with the prompt as context they must not."""
    tok = _sentencepiece_style()
    ids = tok.encode("Hello the world", add_special_tokens=False)
    cut = next(k for k in range(len(ids)) if tok.decode(ids[:k]) == "Hello")
    prompt, generated = ids[:cut], ids[cut:]
    assert tok.decode(generated) == "the world"  # decoded alone, the leading space is lost
    deltas, tail = _stream(tok, generated, prompt=prompt)
    assert "".join(deltas) + tail == " the world"
    deltas, tail = _stream(tok, generated)
    assert "".join(deltas) + tail == "the world"


def test_prompt_context_matches_decoding_prompt_and_output_together(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        cut = rng.randrange(1, len(ids))
        while "\ufffd" in tokenizer.decode(ids[:cut]):  # a prompt ends on a whole character
            cut -= 1
        deltas, tail = _stream(tokenizer, ids[cut:], prompt=ids[:cut])
        assert tokenizer.decode(ids[:cut]) + "".join(deltas) + tail == text


def test_invalid_byte_fallback_run_keeps_streamed_text() -> None:
    """The documented exception: invalid bytes after a streamed byte-fallback character."""
    tok = _sentencepiece_style()
    byte_a, byte_e2 = (tok.backend.token_to_id(t) for t in ("<0x41>", "<0xE2>"))
    assert tok.decode([byte_a, byte_e2]) == "\ufffd\ufffd"  # the decoder spoils the whole run
    deltas, tail = _stream(tok, [byte_a, byte_e2])
    assert deltas == ["A", ""]
    assert tail == "\ufffd"


class _CountingTokenizer(Tokenizer):
    """Records how many ids each decode call sees."""

    def __init__(self, inner: Tokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.decode_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_step_decodes_a_bounded_window() -> None:
    tok = _CountingTokenizer(_byte_level())
    ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    long_prompt = ids[:500]
    deltas, tail = _stream(tok, ids[500:], prompt=long_prompt)
    assert len(ids) > 1000
    assert max(tok.decode_lengths) <= 16
    assert tok.decode(long_prompt) + "".join(deltas) + tail == tok.decode(ids)
