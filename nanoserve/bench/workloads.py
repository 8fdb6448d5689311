"""Prompt generators for the serving benchmark: random lengths, shared prefix, multi-turn chat.

`Workload` is the offline form: token ids and output lengths, for `bench throughput` and the
peers. For a server, every workload is a list of `Conversation`s: a request is one user turn, sent with the whole
conversation so far (system prompt, earlier user turns and the assistant's actual replies). A
single-turn workload is conversations of one turn. Prompts are text built from random tokens of
a local tokenizer and counted with it: `text_of_length(n)` encodes back to exactly n tokens (or as
close as the tokenizer's merges allow), so the lengths are the ones asked for, on the tokenizer the
server uses. The same arguments and seed give the same workload.

- `random`: one turn each, prompt and output lengths uniform in their ranges.
- `shared-prefix`: K system prompts of `prefix_len` tokens times M questions each (SGLang's
  "generated-shared-prefix"); requests are interleaved (prefix 0 question 0, prefix 1 question 0,
  ...) so that every prefix is first seen early and then reused.
- `multi-turn`: each conversation has `turns` user turns; a turn is sent once the previous reply
  has arrived, so its prompt is the previous prompt plus that reply (what a chat client does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from nanoserve.tokenizer import Tokenizer

WORKLOADS = ("random", "shared-prefix", "multi-turn")
_LENGTH_FIX_ROUNDS = 8


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts and output lengths, for the offline benchmarks (the engine and peers
    in process). `random` draws ids below `vocab_size`; the same arguments give the same workload."""

    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @classmethod
    def random(cls, num_prompts: int, input_len_range: tuple[int, int], output_len_range: tuple[int, int],
               vocab_size: int, seed: int) -> Workload:
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
        for name, (lo, hi) in (("input", input_len_range), ("output", output_len_range)):
            if not 1 <= lo <= hi:
                raise ValueError(f"--{name}-len-range needs 1 <= MIN <= MAX, got {lo} {hi}")
        rng = random.Random(seed)
        prompts = tuple(tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*input_len_range)))
                        for _ in range(num_prompts))
        return cls(prompts, tuple(rng.randint(*output_len_range) for _ in range(num_prompts)))



@dataclass(frozen=True, slots=True)
class Conversation:
    """`user_turns[i]` is answered with exactly `output_lens[i]` tokens (ignore_eos); `system`, if
    set, opens the conversation. `prefix_id` names the shared system prompt (shared-prefix only).
    `prompt_ids`, if set, is a single-turn completions prompt sent as token ids instead of text
    (`user_turns` then holds its description for the record)."""

    user_turns: tuple[str, ...]
    output_lens: tuple[int, ...]
    system: str | None = None
    prefix_id: int | None = None
    prompt_ids: tuple[int, ...] | None = None

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, Any]]:
        """Chat messages of user turn `turn`, given the assistant's replies to the earlier turns."""
        msgs: list[dict[str, Any]] = [] if self.system is None else [{"role": "system", "content": self.system}]
        for i in range(turn):
            msgs += [{"role": "user", "content": self.user_turns[i]}, {"role": "assistant", "content": replies[i]}]
        return [*msgs, {"role": "user", "content": self.user_turns[turn]}]

    def prompt(self, turn: int, replies: list[str]) -> str:
        """The completions-endpoint prompt of turn `turn`: the texts concatenated."""
        parts = [] if self.system is None else [self.system]
        for i in range(turn):
            parts += [self.user_turns[i], replies[i]]
        return "".join([*parts, self.user_turns[turn]])


class TextSampler:
    """Random text of a given token length under `tokenizer`, from tokens that decode to plain
    printable text on their own (no special tokens, no partial UTF-8)."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.pool = [i for i in range(tokenizer.vocab_size) if not tokenizer.is_special(i)
                     and (t := tokenizer.decode([i])).isprintable() and t.strip()]
        if not self.pool:
            raise ValueError("the tokenizer has no plain-text tokens to build prompts from")

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def text_of_length(self, n: int) -> str:
        """Text that encodes to n tokens: random tokens decoded, then re-encoded and cut or padded
        until the count is exact (a few rounds; re-encoding can merge across the joints)."""
        ids = [self.rng.choice(self.pool) for _ in range(n)]
        text = self.tok.decode(ids)
        for _ in range(_LENGTH_FIX_ROUNDS):
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) == n:
                break
            ids = ids[:n] + [self.rng.choice(self.pool) for _ in range(n - len(ids))]
            text = self.tok.decode(ids)
        return text


def _lengths(rng: random.Random, count: int, bounds: tuple[int, int], what: str) -> list[int]:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"--{what}-len-range needs 1 <= MIN <= MAX, got {lo} {hi}")
    return [rng.randint(lo, hi) for _ in range(count)]


def random_workload(sampler: TextSampler, num_prompts: int, input_len_range: tuple[int, int],
                    output_len_range: tuple[int, int]) -> list[Conversation]:
    """`num_prompts` single-turn requests with uniform random prompt and output lengths."""
    ins = _lengths(sampler.rng, num_prompts, input_len_range, "input")
    outs = _lengths(sampler.rng, num_prompts, output_len_range, "output")
    return [Conversation((sampler.text_of_length(n),), (m,)) for n, m in zip(ins, outs, strict=True)]


def shared_prefix_workload(sampler: TextSampler, num_prefixes: int, questions_per_prefix: int, prefix_len: int,
                           input_len_range: tuple[int, int], output_len_range: tuple[int, int]) -> list[Conversation]:
    """K system prompts of `prefix_len` tokens (each ending in a newline, so that the question
    starts a new token) times M questions of `input_len_range` tokens, interleaved by question."""
    if num_prefixes < 1 or questions_per_prefix < 1 or prefix_len < 1:
        raise ValueError("the shared-prefix workload needs at least one prefix, one question and one token")
    prefixes = [sampler.text_of_length(prefix_len - 1) + "\n" for _ in range(num_prefixes)]
    total = num_prefixes * questions_per_prefix
    ins = _lengths(sampler.rng, total, input_len_range, "input")
    outs = _lengths(sampler.rng, total, output_len_range, "output")
    return [Conversation((sampler.text_of_length(ins[i]),), (outs[i],), system=prefixes[i % num_prefixes],
                         prefix_id=i % num_prefixes) for i in range(total)]


def multi_turn_workload(sampler: TextSampler, num_conversations: int, turns: int, input_len_range: tuple[int, int],
                        output_len_range: tuple[int, int]) -> list[Conversation]:
    """`num_conversations` chats of `turns` user turns each; lengths are per turn."""
    if turns < 1:
        raise ValueError(f"--turns must be at least 1, got {turns}")
    convs = []
    for _ in range(num_conversations):
        ins = _lengths(sampler.rng, turns, input_len_range, "input")
        outs = _lengths(sampler.rng, turns, output_len_range, "output")
        convs.append(Conversation(tuple(sampler.text_of_length(n) for n in ins), tuple(outs)))
    return convs
