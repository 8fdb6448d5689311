"""Pooling requests: a prompt run for its embedding instead of a continuation.

`PoolingParams` (in `sampling_params`) marks a request as one (`SamplingParams.pooling`);
`Pooler`, held by the model runner, turns the final hidden states (after the model's final norm)
of a pooling sequence's prompt rows into one vector. Such a sequence is scheduled like any
prefill (chunked, batched with generating sequences); the step that computes its last prompt
token yields its vector, and the engine ends it there, decoding nothing.

Invariants. Last-token pooling reads only the last prompt row, so a prefix-cache match is kept.
Mean pooling needs every prompt row, so its sequences skip the prefix-cache match
(`Sequence.needs_every_prompt_row`) and every chunk starts where the previous one ended, or at 0
after a preemption, where the running sum starts again. The running sum is fp32, whatever the
model's dtype. A vector is cut to `dimensions` (when set) and then scaled to unit L2 norm (when
`normalize`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nanoserve.engine.sequence import Sequence

Pooled = tuple[tuple[Sequence, list[float]], ...]  # embeddings of a step, by sequence


class PoolSpan(NamedTuple):
    """A pooling sequence's rows in one step: batch rows `row .. row + num_tokens - 1` hold its
    prompt positions `start .. start + num_tokens - 1`."""

    seq: Sequence
    row: int
    start: int
    num_tokens: int


class Pooler:
    """Pools the hidden states of pooling sequences, step by step; holds each mean-pooled
    sequence's running sum between its chunks (keyed by sequence, dropped by `release`)."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, int], torch.Tensor] = {}

    @torch.inference_mode()
    def pool(self, hidden: torch.Tensor, spans: tuple[PoolSpan, ...]) -> Pooled:
        """The vector of each sequence of `spans` whose prompt ends in this step, in span order;
        the others' rows are added to their running sums."""
        out: list[tuple[Sequence, list[float]]] = []
        for seq, row, start, count in spans:
            params = seq.params.pooling
            assert params is not None, "a pool span of a sequence that does not pool"
            done = start + count == seq.num_prompt_tokens
            if params.method == "last":
                if not done:
                    continue
                vector = hidden[row + count - 1].float()
            else:
                total = hidden[row : row + count].float().sum(dim=0)
                previous = self._sums.pop(seq.key, None)
                if start > 0:
                    assert previous is not None, "a mean-pooled chunk after a chunk that was not pooled"
                    total += previous
                if not done:
                    self._sums[seq.key] = total
                    continue
                vector = total / seq.num_prompt_tokens
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            out.append((seq, vector.tolist()))
        return tuple(out)

    def release(self, seq: Sequence) -> None:
        """Forgets an ended sequence's running sum."""
        self._sums.pop(seq.key, None)
