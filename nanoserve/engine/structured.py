"""Structured output: constrained decoding with llguidance (an Earley parser over a lexer, with a
token trie; masks in microseconds, no torch dependency).

A request's `StructuredOutputs` becomes an llguidance grammar (`grammar_source`); a
`GrammarCompiler` compiles it once against the served tokenizer and keeps the compiled matcher as
a prototype, so each sequence starts from a cheap copy (`GrammarMatcher`). The engine compiles on
the compiler's worker threads (`compile_async`; llguidance releases the GIL while it compiles), so
a constraint that is slow to compile never holds up the engine loop. Each step, the runner
asks the constrained rows' matchers for their masks of allowed tokens (`GrammarCompiler.fill_masks`,
one bit per token, packed 32 to an int32, filled by llguidance's thread pool) and the sampler sets
every other logit to -inf (`unpack_bitmask`). A matcher advances with each token its sequence
appends; a grammar that can take no further token ends its sequence with "stop", and where it may
end or go on, the mask allows the EOS ids too.

Invariants: a matcher only ever consumes tokens its own mask allowed (drafts are not proposed for
constrained sequences), so it never enters an error state while its sequence runs; its state is
the prefix of output tokens appended so far, which preemption by recompute keeps; every matcher a
compiler hands out is counted in `num_live` until `close`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from nanoserve.engine.sampling_params import StructuredOutputs
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# JSON is written as Python's json.dumps writes it (", " and ": ", no other whitespace): free
# whitespace would let a model pad its output until max_tokens.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_source(schema: dict[str, Any] | str) -> dict[str, Any]:
    """A JSON schema with nanoserve's JSON layout options, unless it sets its own `x-guidance`."""
    value = json.loads(schema) if isinstance(schema, str) else schema
    if isinstance(value, bool):  # `true` accepts any JSON value; `false` nothing
        value = {} if value else {"not": {}}
    return {"x-guidance": JSON_OPTIONS, **value}


def grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) of a constraint. Raises ValueError for a grammar
    that is not Lark and does not convert from GBNF."""
    if spec.json is not None or spec.json_object:
        schema = json_schema_source(spec.json if spec.json is not None else {"type": "object"})
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)
    except Exception as e:  # the converter raises plain exceptions of several kinds
        raise ValueError(f"the grammar is neither Lark nor GBNF: {e}") from e
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarMatcher:
    """One sequence's position in its grammar. Not thread-safe: the engine thread advances it, and
    a mask fill runs only while the engine thread waits for it."""

    __slots__ = ("_compiler", "_matcher")

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._compiler: GrammarCompiler | None = compiler

    def accept(self, token: int) -> bool:
        """Advances by one appended token; False (the matcher then stays in its error state) if
        the grammar rejects it, which a token its mask allowed should never be."""
        if self._matcher.consume_token(token):
            return True
        log.error("the grammar rejected token %d, which its mask allowed: %s", token, self._matcher.get_error())
        return False

    @property
    def finished(self) -> bool:
        """Whether the grammar can take no further token (the output is complete)."""
        return self._matcher.is_stopped()

    def close(self) -> None:
        """Frees the matcher's count (idempotent)."""
        if self._compiler is not None:
            self._compiler.num_live -= 1
            self._compiler = None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The packed masks [n, words] int32 (little-endian bit order) as booleans [n, vocab_size] on
    `device`: each byte selects its 8 booleans from a 256 x 8 table in one flat `index_select`
    (far cheaper than 32 shifts per word, or than indexing the table with a 2-D index)."""
    table = ((torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1).bool()
    as_bytes = bitmask.to(device).view(torch.uint8)  # [n, 4 * words]; byte k holds tokens 8k .. 8k + 7
    return table.index_select(0, as_bytes.flatten().long()).view(bitmask.shape[0], -1)[:, :vocab_size]


class GrammarCompiler:
    """Compiles constraints against one tokenizer and hands out matchers.

    The llguidance tokenizer is built on first use (a second or so for a 150K vocabulary).
    Compiled grammars are kept, least recently used first out, up to `cache_size`; a matcher is
    a copy of its grammar's compiled prototype. EOS ids are the tokenizer's stop ids. `compile`
    may run on any thread (the cache and the tokenizer are behind a lock, never held while
    compiling); matchers and masks belong to the engine thread.
    """

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 64, num_workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self.num_workers = num_workers
        self.num_live = 0  # matchers handed out and not closed
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._workers: ThreadPoolExecutor | None = None

    @property
    def executor(self) -> llguidance.LLExecutor:
        """llguidance's thread pool for batched masks (created on first use)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
        return self._executor

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                eos = sorted(self.tokenizer.stop_token_ids)
                self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(),
                                                           n_vocab=self.tokenizer.vocab_size, eos_token=eos or None)
            return self._lltokenizer

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled prototype of `spec` (from the cache when seen before), compiled on the
        calling thread. Raises ValueError, with llguidance's message, for a constraint that does
        not compile."""
        source = grammar_source(spec)
        return self._cached(source) or self._compile(spec.kind, source)

    def compile_async(self, spec: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        """The compiled prototype of `spec`: a future already done when it is cached, else one
        that `compile`s on one of the compiler's `num_workers` threads (started on first use). A
        constraint that does not compile sets its ValueError; one whose source cannot be made
        (`grammar_source`) raises it here."""
        source = grammar_source(spec)
        if (proto := self._cached(source)) is not None:
            done: Future[llguidance.LLMatcher] = Future()
            done.set_result(proto)
            return done
        if self._workers is None:
            self._workers = ThreadPoolExecutor(self.num_workers, thread_name_prefix="nanoserve-grammar")
        return self._workers.submit(self._compile, spec.kind, source)

    def _cached(self, source: str) -> llguidance.LLMatcher | None:
        with self._lock:
            proto = self._compiled.get(source)
            if proto is not None:
                self._compiled.move_to_end(source)
            return proto

    def _compile(self, kind: str, source: str) -> llguidance.LLMatcher:
        proto = llguidance.LLMatcher(self._llg_tokenizer(), source, log_level=0)
        if proto.is_error():
            raise ValueError(f"the {kind} constraint does not compile: {proto.get_error()}")
        first = proto.deep_copy()
        first.compute_bitmask()  # a grammar that cannot begin (a schema that is only a reference to
        if first.is_error():  # itself) fails here, not after a request has run with it
            raise ValueError(f"the {kind} constraint does not compile: it admits no output "
                             f"({first.get_error().splitlines()[0]})")
        with self._lock:
            self._compiled[source] = proto
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return proto

    def fill_masks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """The packed masks [len(matchers), ceil(V / 32)] int32 of allowed next tokens, V the
        tokenizer's vocabulary: bit b of word w is token 32 w + b. Filled in parallel by
        llguidance's threads, which release the GIL."""
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                              bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask

    def matcher(self, proto: llguidance.LLMatcher) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar (`compile`'s prototype); `close` it
        when its sequence ends."""
        m = GrammarMatcher(proto.deep_copy(), self)
        self.num_live += 1
        return m
