"""SentencePiece BPE vocabularies (Llama 1/2, Mistral 7B; Gemma 4's with merges) as `tokenizers` BPE models.

SentencePiece's BPE encoder starts from the characters of the text (spaces written as U+2581
"▁", one prepended) and repeatedly merges the adjacent pair whose concatenation is the piece with
the highest score, leftmost first among equals; a character outside the vocabulary becomes its
UTF-8 bytes as `<0xXX>` pieces (byte fallback). That is BPE with one merge per way of splitting a
piece into two pieces, ranked by the piece's score: what `build` constructs from a vocabulary and
its scores, as a GGUF file of `tokenizer.ggml.model` "llama" stores them.

The text is prefixed as llama.cpp does: with `add_space_prefix`, every run of text that starts the
input or follows a special token gets a leading "▁" (the normalizer runs once per such run).

Gemma 4's GGUF vocabulary (`build_from_merges`) is such pieces with ranked merges stored, which
llama.cpp applies to runs of newlines and runs of other text, with no "▁" prepended.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from gguf import TokenType
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"
_MERGEABLE = (TokenType.NORMAL, TokenType.USER_DEFINED)


def merges_by_score(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of pieces whose concatenation is a normal or user-defined piece,
    best-scoring result first (ties: lower id of the result, then the shorter left part)."""
    ids = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind in _MERGEABLE}
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], unk_id: int | None,
          add_space_prefix: bool) -> tokenizers.Tokenizer:
    """The BPE tokenizer of a SentencePiece vocabulary (special and added tokens not yet added)."""
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind != TokenType.UNUSED}
    unk = None if unk_id is None else tokens[unk_id]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges_by_score(tokens, scores, types),
                                              unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def build_from_merges(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int]) -> tokenizers.Tokenizer:
    """A BPE tokenizer over SentencePiece-style pieces with ranked merges (Gemma 4's, GGUF
    `tokenizer.ggml.model` "gemma4"), split as llama.cpp splits it: spaces written as "▁" (none
    prepended), the text cut into runs of newlines and runs of anything else, each merged on its
    own; a run found whole in the vocabulary is one token (llama.cpp does so for newline runs; a
    whole line that is a piece BPE would not reach is the one way this can differ from it); a
    piece outside the vocabulary becomes `<0xXX>` byte pieces. Special and added tokens not yet added."""
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind != TokenType.UNUSED}
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True, ignore_merges=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend
