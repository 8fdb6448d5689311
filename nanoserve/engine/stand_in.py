"""A deterministic stand-in model (no weights) for scheduler/KV tests and bookkeeping benchmarks.

It implements the runner's `Model` protocol and predicts only from what it reads back out of its
KV cache, so a wrong block table, slot mapping, position, prefix-cache hit or preemption shows up
as a wrong token. With `t_0 .. t_{L-1}` the tokens of a sequence read back in context order:

    next = (P * sum_i (i + 1) * t_i + C) mod V

Each step the forward pass writes every new token id (as K) and its position + 1 (as V) into the
cache through `meta.slot_mapping`, then, for each sequence's last query token, gathers the whole
context through `meta.block_tables` and `meta.seq_lens` (vectorised and masked: no Python loop
over tokens or sequences). A stored position that disagrees with its place in the context adds
the number of such disagreements to the sum, so it changes the token too.

Exactness: the KV cache is float64 and every intermediate is an integer below 2**53 for
contexts up to `STAND_IN_MAX_LEN` tokens and V <= 4096, so the batched result equals
`stand_in_next` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import KVShape

STAND_IN_VOCAB = 1024
STAND_IN_MAX_LEN = 4096
STAND_IN_KV_SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=1)
_P = 7919
_C = 17
_PEAK = 30.0  # logit of the predicted token (all others are 0): near one-hot even when sampling


def stand_in_next(tokens: Sequence[int], vocab_size: int = STAND_IN_VOCAB) -> int:
    """The token the stand-in predicts after `tokens` (pure-Python reference)."""
    return (_P * sum((i + 1) * t for i, t in enumerate(tokens)) + _C) % vocab_size


def stand_in_generate(prompt: Sequence[int], num_tokens: int, vocab_size: int = STAND_IN_VOCAB) -> list[int]:
    """The stand-in's greedy continuation of `prompt`, `num_tokens` long, computed incrementally."""
    acc = sum((i + 1) * t for i, t in enumerate(prompt))
    length, out = len(prompt), []
    for _ in range(num_tokens):
        token = (_P * acc + _C) % vocab_size
        out.append(token)
        length += 1
        acc += length * token
    return out


class StandInModel:
    """The stand-in model: KV cache `[1, 2, num_blocks, block_size, 1, 1]` float64, holding token
    ids as K and positions + 1 as V. Its "hidden state" is one float64 per query token: the
    predicted id on each sequence's last query token, -1 elsewhere (never sampled)."""

    dtype = torch.float64

    def __init__(self, vocab_size: int = STAND_IN_VOCAB) -> None:
        if not 2 <= vocab_size <= 4096:
            raise ValueError(f"the stand-in's vocabulary must be in [2, 4096], got {vocab_size}")
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        bs, kv = meta.block_size, kv_caches[0]  # [2, num_blocks, block_size, 1, 1]
        kv.view(2, -1)[0].index_copy_(0, meta.slot_mapping, input_ids.to(self.dtype))
        kv.view(2, -1)[1].index_copy_(0, meta.slot_mapping, (positions + 1).to(self.dtype))
        width = -(-max(meta.seq_lens_cpu) // bs)
        tables = meta.block_tables[:, :width]
        context = kv.view(2, -1, bs).index_select(1, tables.flatten()).view(2, len(tables), width * bs)
        place = torch.arange(1, width * bs + 1, dtype=self.dtype, device=input_ids.device)  # i + 1
        valid = place <= meta.seq_lens[:, None]
        keys, values = context * valid  # tokens and positions + 1, zero past each sequence's end
        misplaced = (values != place).sum(1) - (~valid).sum(1)
        acc = (keys @ place) * _P + _C + misplaced
        hidden = torch.full((input_ids.numel(),), -1.0, dtype=self.dtype, device=input_ids.device)
        last = torch.tensor(meta.query_start_loc_cpu[1:], device=input_ids.device) - 1
        hidden[last] = torch.remainder(acc, self.vocab_size)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, V]: `_PEAK` at the predicted id, 0 elsewhere."""
        logits = torch.zeros(hidden.numel(), self.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, hidden.long().unsqueeze(1), _PEAK)


def stand_in_engine(vocab_size: int = STAND_IN_VOCAB, **engine_args: Any) -> LLMEngine:
    """An `LLMEngine` around the stand-in (no tokenizer: token ids only). `engine_args` are
    EngineArgs fields; max_model_len defaults to, and is capped at, STAND_IN_MAX_LEN."""
    args = EngineArgs(**engine_args).resolved(STAND_IN_MAX_LEN, None)
    return LLMEngine(StandInModel(vocab_size), None, STAND_IN_KV_SHAPE, vocab_size, args)
