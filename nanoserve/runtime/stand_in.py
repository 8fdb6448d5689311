"""A deterministic stand-in model (no weights) for scheduler/KV tests and bookkeeping benchmarks.

It implements the runner's `Model` protocol and predicts only from what it reads back out of its
KV cache, so a wrong block table, slot mapping, position, prefix-cache hit or preemption shows up
as a wrong token. With `t_0 .. t_{L-1}` the tokens of a sequence read back in context order:

    next = (P * sum_i (i + 1) * t_i + C) mod V

Each step the forward pass writes every new token into the K plane of the cache through
`meta.slot_mapping`, as `t + S * (position + 1)`, then, for each sequence's last query token,
gathers the whole context through `meta.block_tables` and `meta.seq_lens` (vectorised and masked:
no Python loop over tokens or sequences) and forms `sum_i (i + 1) * K_i`. With every position
right, the position terms add up to `S * sum_i (i + 1)**2`, which is subtracted; a wrong position
leaves `S * sum_i (i + 1) * (p_i - i)` behind (S is odd, so this survives the mod V of a
power-of-two vocabulary unless the sum is a multiple of V).

Exactness: the cache is float64 and every intermediate is an integer below 2**53 for contexts up
to `STAND_IN_MAX_LEN` tokens and V <= 4096 (the sum is reduced mod V before it is multiplied by
P), so the batched result equals `stand_in_next` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoserve.attention import AttentionBackend, AttentionMetadata
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_protocol import KVShape
from nanoserve.engine.spec_decode import NgramProposer
from nanoserve.runtime.builder import engine_from_model

STAND_IN_VOCAB = 1024
STAND_IN_MAX_LEN = 4096
STAND_IN_KV_SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=1)
_P = 7919
_C = 17
_S = 4099  # weight of position + 1 in a stored K (odd; larger than any token id)
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
    """The stand-in model: KV cache `[1, 2, num_blocks, block_size, 1, 1]` float64, whose K plane
    holds `token + S * (position + 1)` (the V plane is unused). Its "hidden state" is one float64
    per query token: the id predicted from the tokens up to and including it, read back from the
    cache (so every position of a chunk can be sampled or verified, as with a real model)."""

    dtype = torch.float64

    def __init__(self, vocab_size: int = STAND_IN_VOCAB) -> None:
        if not 2 <= vocab_size <= 4096:
            raise ValueError(f"the stand-in's vocabulary must be in [2, 4096], got {vocab_size}")
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        bs, dev = meta.block_size, input_ids.device
        keys = kv_caches[0, 0].view(-1, bs)  # [num_blocks, block_size]
        keys.view(-1).index_copy_(0, meta.slot_mapping, (input_ids + _S * (positions + 1)).to(self.dtype))
        width = -(-max(meta.seq_lens_cpu) // bs)
        tables = meta.block_tables[:, :width]
        context = keys.index_select(0, tables.flatten()).view(len(tables), width * bs)
        place = torch.arange(1, width * bs + 1, dtype=self.dtype, device=dev)  # i + 1
        q_lens = torch.tensor(meta.query_start_loc_cpu, device=dev).diff()
        context = context[torch.repeat_interleave(torch.arange(len(tables), device=dev), q_lens)]  # per token
        lens = (positions + 1).to(self.dtype)  # the context each query token sees
        context.masked_fill_(place > lens[:, None], 0.0)
        expected_positions = _S * (lens * (lens + 1) * (2 * lens + 1) / 6)  # S * sum_i (i + 1)**2
        weighted = torch.remainder(context @ place - expected_positions, self.vocab_size)
        return torch.remainder(weighted * _P + _C, self.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, V]: `_PEAK` at the predicted id, 0 elsewhere."""
        logits = torch.zeros(hidden.numel(), self.vocab_size, dtype=torch.float32, device=hidden.device)
        return logits.scatter_(1, hidden.long().unsqueeze(1), _PEAK)


def stand_in_engine(vocab_size: int = STAND_IN_VOCAB, **engine_args: Any) -> LLMEngine:
    """An `LLMEngine` around the stand-in (no tokenizer: token ids only). `engine_args` are
    EngineArgs fields; max_model_len defaults to, and is capped at, STAND_IN_MAX_LEN. Speculation:
    n-gram only (a draft model needs weights)."""
    args = EngineArgs(**engine_args).resolved(STAND_IN_MAX_LEN, None)
    proposer = NgramProposer() if args.spec_method == "ngram" else None
    return engine_from_model(StandInModel(vocab_size), None, STAND_IN_KV_SHAPE, vocab_size, args, proposer=proposer)
