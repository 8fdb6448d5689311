"""Per-sequence output text: incremental detokenization and stop strings.

Text that could still turn into a stop string is held back until it cannot (so a client never
sees the start of a stop string that is later cut), and a matched stop string is not emitted
(unless `include_stop`: then the text ends with it).
"""

from __future__ import annotations

from nanoserve.tokenizer.detokenizer import IncrementalDetokenizer
from nanoserve.tokenizer.tokenizer import Tokenizer


class TextStream:
    """Invariant: `text` (all emitted deltas) never changes once emitted, and contains a stop
    string only at its end, and only with `include_stop`; `_pending` holds the decoded text not
    yet emitted."""

    __slots__ = ("_detok", "_include_stop", "_max_stop", "_pending", "stopped", "stops", "text")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._include_stop = include_stop
        self.stops = stops
        self._max_stop = max((len(s) for s in stops), default=0)
        self._pending = ""
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Adds a token; returns the text that became final. Sets `stopped` on a stop string."""
        self._pending += self._detok.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """End of sequence: releases everything still held back (unless a stop string ended it)."""
        if self.stopped:
            return ""
        self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self._pending
        if self.stops and pending:
            hits = [(i, -len(s)) for s in self.stops if (i := pending.find(s)) >= 0]
            if hits:
                self.stopped = True
                start, minus_len = min(hits)  # the first stop string, the longest one starting there
                return self._emit(pending[: start - minus_len if self._include_stop else start])
            if not final:
                return self._emit(pending[: len(pending) - self._held(pending)])
        return self._emit(pending)

    def _held(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        for k in range(min(len(pending), self._max_stop - 1), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _emit(self, delta: str) -> str:
        self._pending = self._pending[len(delta) :] if not self.stopped else ""
        self.text += delta
        return delta
