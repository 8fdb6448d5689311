"""Incremental detokenization: token ids in, UTF-8-safe text deltas out (vLLM's offset scheme)."""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.tokenizer.tokenizer import Tokenizer

# How many prompt tokens to keep as left context for the first generated tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Invariants: deltas never split a UTF-8 character (no U+FFFD is emitted while bytes of a
    character are still pending), and text once emitted is never changed. Without `prompt_ids`,
    `"".join(deltas) + flush() == tokenizer.decode(all_ids, skip_special_tokens)`; with them, the
    first generated tokens decode as they would after the prompt (e.g. a SentencePiece word keeps
    its leading space).

    One exception to the equality, inherent to streaming: a byte-fallback decoder (Llama-2,
    Mistral) turns a whole run of `<0xNN>` tokens into U+FFFD when the run is not valid UTF-8.
    If a model extends a run whose valid characters were already streamed with invalid bytes, the
    stream keeps those characters while the one-shot decode replaces them.

    Method: the ids seen so far are split by two offsets. `ids[prefix:read]` was already emitted
    and is decoded only as left context; `ids[read:]` is pending. Each push decodes
    `ids[prefix:]` and emits what it adds to the context text, unless that ends in U+FFFD (an
    incomplete character). On emission the window slides: prefix <- read, read <- len(ids). So a
    step costs O(window) decoding, not O(sequence).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        # The context must start on a whole character: one that starts inside a character decodes
        # to U+FFFD, and a byte-fallback decoder would then spoil every byte token after it.
        while self._ids and self._decode(self._ids).startswith(_REPLACEMENT_CHAR):
            del self._ids[0]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became final (maybe "")."""
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(window_text)

    def flush(self) -> str:
        """End of stream: return any text still held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._ids[self._prefix_offset :])
        if len(window_text) <= len(self._prefix_text):
            return ""
        return self._emit(window_text)

    def _emit(self, window_text: str) -> str:
        """Emit `window_text` past the context and slide the window to the end of `_ids`."""
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._trim()
        self.text += delta
        return delta

    def _trim(self) -> None:
        """Drop ids before the window so memory stays O(window)."""
        if self._prefix_offset:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
