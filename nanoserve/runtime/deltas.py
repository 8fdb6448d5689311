"""Merging a sequence's consecutive output deltas into one: what an `OutputStream` does with the
deltas that piled up for its consumer (one that fell behind, or woken every `stream_interval`
steps), so that it writes one chunk per sequence instead of one per engine step."""

from __future__ import annotations

import dataclasses

from nanoserve.engine.outputs import SequenceDelta


def coalesce(deltas: list[SequenceDelta]) -> list[SequenceDelta]:
    """`deltas` (in arrival order) with each sequence's consecutive deltas merged into one: token
    ids, text and logprobs concatenated in order, prediction counts summed, finish reason and the
    other counts from the last, prompt logprobs from the first that has them (only a sequence's
    first delta does).

    Invariants: per sequence, the concatenated token ids, text and logprobs are unchanged, and
    its merged deltas keep their order; a delta after a finished one, or one whose logprobs are
    present where the previous one's are absent (or the reverse), starts a new delta. The input
    deltas are never modified. Sequences appear in the order of their first delta.
    """
    out: list[SequenceDelta] = []
    last: dict[tuple[str, int], int] = {}  # sequence -> position in `out` of its latest delta
    for d in deltas:
        key = (d.request_id, d.index)
        i = last.get(key)
        if i is None or not _mergeable(out[i], d):
            last[key] = len(out)
            out.append(d)
            continue
        prev = out[i]
        out[i] = dataclasses.replace(
            d, token_ids=prev.token_ids + d.token_ids, text=prev.text + d.text,
            logprobs=None if prev.logprobs is None or d.logprobs is None else prev.logprobs + d.logprobs,
            top_logprobs=(None if prev.top_logprobs is None or d.top_logprobs is None
                          else prev.top_logprobs + d.top_logprobs),
            prompt_logprobs=prev.prompt_logprobs if prev.prompt_logprobs is not None else d.prompt_logprobs,
            accepted_prediction_tokens=prev.accepted_prediction_tokens + d.accepted_prediction_tokens,
            rejected_prediction_tokens=prev.rejected_prediction_tokens + d.rejected_prediction_tokens,
        )
    return out


def _mergeable(prev: SequenceDelta, d: SequenceDelta) -> bool:
    return (not prev.finished and (prev.logprobs is None) == (d.logprobs is None)
            and (prev.top_logprobs is None) == (d.top_logprobs is None))
