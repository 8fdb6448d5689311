"""Predicted Outputs: a request's predicted text as its speculative drafts.

OpenAI's `prediction` (`{"type": "content", "content": "..."}`) is text the answer is expected to
mostly repeat (a file to be edited in a few places). `PredictionProposer` proposes, for each
sequence with a prediction, the next tokens of the prediction after the place the output has
reached in it; the engine verifies them like any drafts (`spec_decode.verify`,
`verify_greedy`), so the output is what it would have been without the prediction, and only the
number of forward passes changes.

Where the output has reached is a cursor into the prediction's tokens. While the output follows
the prediction the cursor advances with it (each accepted draft, then the target's own token if
it is the prediction's next one). When the output leaves the prediction (an edit), the cursor is
found again by prompt lookup restricted to the prediction (Saxena 2023, "prompt lookup
decoding"): the longest suffix of the sequence (up to `max_n` tokens) that occurs in the
prediction, taking the first such occurrence at or after the old cursor (an edit is local, and
the text after it is further on), else the last one before it. A match shorter than `min_n`
(2 by default) proposes nothing: single tokens (a newline, an indent) occur all over a code file,
and drafts after them are mostly rejected, each costing a row of the verification pass, so a
prediction the output does not follow at all would otherwise slow it down. So the drafts
re-synchronise two tokens after an edit ends.

Invariant: a sequence's state exists from its first proposal until `release`; its `next` is the
index in the prediction of the token expected to come next, valid when the sequence's last token
is the prediction's token before it (checked at each proposal, never assumed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode import Proposal


@dataclass(slots=True)
class _Cursor:
    tokens: np.ndarray  # the prediction's token ids (int64)
    next: int  # index of the prediction token expected next (0 before the first output token)
    start: int | None = None  # where the pending drafts began in the prediction (None: no drafts pending)


class PredictionProposer:
    """Drafts from each sequence's `params.prediction_token_ids` (a `spec_decode.Proposer`); its
    drafts are point masses (q = None), verified exactly for greedy and sampled requests alike."""

    def __init__(self, max_n: int = 16, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._cursors: dict[Sequence, _Cursor] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [Proposal(self._draft(seq, k), None) for seq, k in zip(seqs, budgets, strict=True)]

    def _draft(self, seq: Sequence, k: int) -> list[int]:
        cursor = self._cursors.get(seq)
        if cursor is None:
            tokens = np.asarray(seq.params.prediction_token_ids or [], dtype=np.int64)
            cursor = self._cursors[seq] = _Cursor(tokens, 0)
        pred, last = cursor.tokens, seq.all_token_ids[-1]
        if cursor.next < len(pred) and pred[cursor.next] == last:
            cursor.next += 1  # the output follows the prediction
        else:
            found = match(pred, seq.all_token_ids, cursor.next, self.max_n, self.min_n)
            if found is None:
                cursor.start = None
                return []
            cursor.next = found
        drafts = pred[cursor.next : cursor.next + k].tolist()
        cursor.start = cursor.next if drafts else None
        return drafts

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        cursor = self._cursors.get(seq)
        if cursor is not None and cursor.start is not None:
            cursor.next = cursor.start + num_accepted
            cursor.start = None

    def release(self, seq: Sequence) -> None:
        self._cursors.pop(seq, None)


def match(prediction: np.ndarray, tokens: list[int], hint: int, max_n: int, min_n: int = 1) -> int | None:
    """The index in `prediction` just after an occurrence of the longest suffix of `tokens` (at
    most `max_n` tokens) found in it: the first occurrence ending at or after `hint - 1`, else the
    last one; None when that suffix is shorter than `min_n` (or the last token does not occur).

    Candidates are the positions holding the last token, narrowed one suffix token at a time
    while any survive, so only those few positions are compared, never whole windows."""
    ends = np.flatnonzero(prediction == tokens[-1])
    n = 1
    for j in range(1, min(max_n, len(tokens))):
        ends_j = ends[ends >= j]
        longer = ends_j[prediction[ends_j - j] == tokens[-1 - j]]
        if longer.size == 0:
            break
        ends, n = longer, j + 1
    if ends.size == 0 or n < min_n:
        return None
    ahead = ends[ends >= hint - 1]
    return int(ahead[0] if ahead.size else ends[-1]) + 1
