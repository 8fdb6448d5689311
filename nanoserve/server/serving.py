"""What the chat and completion handlers share: engine access, admission, usage, logprobs and the
non-streaming wait that aborts when the client goes away.

Invariant: every check that can reject a request (model name, fields, prompt length, queue
bound) runs before a stream starts, so a rejected request gets a status code, never a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from nanoserve.engine.outputs import EngineLimits, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.structured import GrammarCompiler
from nanoserve.runtime.async_engine import (
    AsyncEngine,
    EngineError,
    EngineUnavailableError,
    OutputStream,
    QueueFullError,
)
from nanoserve.runtime.engine_core import EngineInfo, EngineState
from nanoserve.server.chat.reasoning_parsers import reasoning_parser_name
from nanoserve.server.chat.tool_parsers.calls import ToolCallParser
from nanoserve.server.chat.tool_parsers.json_list import JsonListParser
from nanoserve.server.chat.tool_parsers.registry import TOOL_PARSERS, parser_factory
from nanoserve.server.protocol.errors import UNSUPPORTED_FIELD, APIError
from nanoserve.server.protocol.openai import REFUSED_FIELDS
from nanoserve.tokenizer import Tokenizer
from nanoserve.tokenizer.prompt_pool import PromptLimits, PromptPool

log = logging.getLogger(__name__)
_T = TypeVar("_T")

RETRY_AFTER_S = 1
GRAMMAR_COMPILE_TIMEOUT_S = 10.0


@dataclass(slots=True)
class GrammarGate:
    """Compiles a request's output constraint in the front end before the request is queued: on a
    worker thread (never the event loop), within `timeout_s`, so that a constraint the engine
    cannot compile, or one that takes too long, is a 400 before any stream starts. The engine
    compiles it again, on its compiler's threads, while the request waits unscheduled (see
    `LLMEngine.add_request`). A compile that times out runs on in its thread until llguidance's
    own resource limits end it."""

    timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S
    compiler: GrammarCompiler | None = None

    async def check(self, tok: Tokenizer, params: SamplingParams, param: str | None) -> None:
        spec = params.structured
        if spec is None:
            return
        if self.compiler is None or self.compiler.tokenizer is not tok:
            self.compiler = GrammarCompiler(tok)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compiler.compile, spec), self.timeout_s)
        except TimeoutError as e:
            raise APIError(400, f"the {spec.kind} constraint did not compile within {self.timeout_s:g} s",
                           param=param) from e
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e


@dataclass(slots=True)
class PromptGate:
    """Renders chat templates and tokenizes prompts in worker processes (`PromptPool`s: one for chat
    templates, one for plain text, so one kind of work cannot starve the other), never on the
    event loop's interpreter lock, each call under the pools' deadline and memory limit. Before any
    of that, a text longer than the longest one that could fit the context (`max_prompt_chars`) is
    a 400. The pools start on first use and end with `close`."""

    workers: int = 2
    limits: PromptLimits = field(default_factory=PromptLimits)
    _templates: PromptPool | None = None
    _text: PromptPool | None = None
    _starting: asyncio.Lock = field(default_factory=asyncio.Lock)  # one start of each pool, however many ask

    async def encode_chat(self, tok: Tokenizer, limits: EngineLimits, messages: list[dict[str, Any]],
                          **kwargs: Any) -> list[int]:
        """The rendered chat's ids; a 400 naming `messages` for a template that fails or passes its
        bounds (output size, time, memory), or a conversation too long to fit."""
        bound = max_prompt_chars(tok, limits)
        _check_chars(_text_chars(messages), bound, "messages")
        async with self._starting:
            if self._templates is None:
                self._templates = await asyncio.to_thread(PromptPool, tok, self.workers, self.limits,
                                                          "nanoserve-template")
        try:
            ids: list[int] = await self._templates.call("encode_chat", messages, output_limit=bound, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        return ids

    async def encode(self, tok: Tokenizer, limits: EngineLimits, text: str, param: str,
                     add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; a 400 naming `param` for a text too long to fit, or one that passes the
        pool's bounds."""
        _check_chars(len(text), max_prompt_chars(tok, limits), param)
        async with self._starting:
            if self._text is None:
                self._text = await asyncio.to_thread(PromptPool, tok, max(1, self.workers // 2), self.limits,
                                                     "nanoserve-tokenize")
        try:
            ids: list[int] = await self._text.call("encode", text, add_special_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e
        return ids

    def close(self) -> None:
        for pool in (self._templates, self._text):
            if pool is not None:
                pool.close()


def max_prompt_chars(tok: Tokenizer, limits: EngineLimits) -> int:
    """Characters past which a text cannot fit the context: no token covers more than the longest
    vocabulary entry's characters (doubled for normalizers that drop characters)."""
    return 2 * limits.max_model_len * tok.max_token_chars


def _check_chars(chars: int, bound: int, param: str) -> None:
    if chars > bound:
        raise APIError(400, f"the prompt is {chars} characters long, more than could fit the context "
                       f"({bound} characters at most)", param=param)


def _text_chars(value: Any) -> int:
    """Characters in the strings of a JSON-like value."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    return 0


@dataclass(frozen=True, slots=True)
class Serving:
    """The served engine and the name clients must use for it."""

    engine: AsyncEngine
    model_name: str
    tool_call_parser: str = "auto"  # a name of TOOL_PARSERS (nanoserve.server.chat.tool_parsers.registry)
    reasoning_parser: str = "auto"  # a name of REASONING_PARSERS (nanoserve.server.chat.reasoning_parsers)
    grammars: GrammarGate = field(default_factory=GrammarGate)
    prompts: PromptGate = field(default_factory=PromptGate)
    keep_alive_s: float | None = None  # a silent stream's keep-alive comment interval (see sse)
    ignore_unknown_fields: bool = False  # drop (and log) request fields no API defines, rather than a 400

    def tool_parser(self, tok: Tokenizer, forced: bool = False) -> type[ToolCallParser]:
        """The parser of tool calls in this model's output. When the chat template shows no format
        nanoserve knows and no `--tool-call-parser` names one: `JsonListParser` for `forced` calls
        (the grammar writes them as a JSON array), else a 400."""
        parser = parser_factory(self.tool_call_parser, tok.tool_chat_template or tok.chat_template)
        if parser is None and forced:
            return JsonListParser
        if parser is None:
            raise APIError(400, "this model's chat template shows no tool-call format nanoserve can parse; start the "
                           f"server with --tool-call-parser {TOOL_PARSERS.alternatives()} (the format the model "
                           "writes its calls in), or with a --chat-template that shows it", param="tools")
        return parser

    def reasoning_format(self, tok: Tokenizer) -> str | None:
        """The reasoning parser of this model's chat replies (None: the text has no think block)."""
        return reasoning_parser_name(self.reasoning_parser, tok.chat_template)

    def running_info(self) -> EngineInfo:
        """The loaded engine's tokenizer and limits, or a 503 while it is loading, dead or shutting
        down."""
        if self.engine.info is None or self.engine.state is not EngineState.RUNNING:
            raise APIError(503, self.engine.unavailable_reason(), code="engine_unavailable")
        return self.engine.info

    def tokenizer(self) -> Tokenizer:
        tok = self.running_info().tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer")
        return tok

    def check_request(self, body: BaseModel, model: str | None) -> None:
        """404 for a model other than the served one (as OpenAI and vLLM answer); 400 naming the
        first field nanoserve does not implement (a field sent as null is unset, so allowed): one
        of `REFUSED_FIELDS` always, a name no API defines unless `ignore_unknown_fields`, which
        logs and drops those instead."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        extra = body.model_extra or {}
        unknown = sorted(k for k, v in extra.items() if v is not None)
        for name in unknown:
            if name in REFUSED_FIELDS:
                raise APIError(400, f"{REFUSED_FIELDS[name]} (request field `{name}`)", param=name,
                               code=UNSUPPORTED_FIELD)
        if unknown and self.ignore_unknown_fields:
            log.warning("dropping request fields that no API defines: %s", ", ".join(unknown))
            for name in unknown:
                del extra[name]
        elif unknown:
            raise APIError(400, f"unsupported request field{'s' if len(unknown) > 1 else ''}: "
                           f"{', '.join(unknown)}", param=unknown[0], code=UNSUPPORTED_FIELD)

    def admit(self, count: int = 1) -> None:
        """A 429 (with Retry-After) when `count` more sequences (prompts times n) would overflow the
        queue, a 503 when the engine is not running: asked before a request's text is rendered or
        tokenized."""
        self._admitted(lambda: self.engine.admit(count))

    def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int,
               kind: str) -> OutputStream:
        """Hands validated prompts to the engine: 429 (with Retry-After) when the queue is full."""
        return self._admitted(lambda: self.engine.add(prompts, params, priority=priority, kind=kind))

    def _admitted(self, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except QueueFullError as e:
            raise APIError(429, f"the server is overloaded: {e}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except EngineUnavailableError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e


def validate_prompt(limits: EngineLimits, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
    """400, with the numbers, for a prompt the engine could never run, or (naming the field) a
    token id outside the vocabulary in logit_bias or allowed_token_ids."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise APIError(400, f"{name} token ids must be in [0, {limits.vocab_size})", param=name)
    try:
        limits.validate(prompt_ids, params)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


def engine_error(error: EngineError) -> APIError:
    """The status of a request the engine failed: 503 if it was unavailable, else 500."""
    status = 503 if isinstance(error, EngineUnavailableError) else 500
    return APIError(status, str(error), code="engine_unavailable" if status == 503 else "engine_error")


def stream_error(error: Exception, path: str = "") -> dict[str, Any]:
    """The error event that ends a stream that had already started, in the shape of the route at
    `path` (see `APIError.body`)."""
    if isinstance(error, EngineError):
        return engine_error(error).body(path)
    log.error("a stream failed", exc_info=error)
    return APIError(500, f"internal server error: {type(error).__name__}").body(path)


@dataclass(slots=True)
class ChoiceOutput:
    """One choice of a non-streamed response, folded from its deltas."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None

    def add(self, d: SequenceDelta, logprobs: list[Any] | None) -> None:
        self.text.append(d.text)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        self.finish_reason = d.finish_reason or self.finish_reason


@dataclass(slots=True)
class UsageTally:
    """Token counts of one API request, folded from its deltas."""

    prompt: dict[str, int] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    completion: int = 0
    accepted_prediction: int = 0
    rejected_prediction: int = 0

    def add(self, d: SequenceDelta) -> None:
        self.prompt[d.request_id] = d.num_prompt_tokens
        if d.index == 0:
            self.cached[d.request_id] = d.num_cached_tokens
        self.completion += len(d.token_ids)
        self.accepted_prediction += d.accepted_prediction_tokens
        self.rejected_prediction += d.rejected_prediction_tokens

    def body(self) -> dict[str, Any]:
        """OpenAI's usage object. `completion_tokens_details` counts the `prediction`'s tokens
        verified as drafts: accepted (they are output) and rejected (computed, not output, and not
        in completion_tokens: nanoserve counts only the tokens it returns)."""
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
                "completion_tokens_details": {"accepted_prediction_tokens": self.accepted_prediction,
                                              "rejected_prediction_tokens": self.rejected_prediction}}


def now_s() -> int:
    return int(time.time())


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok: Tokenizer, d: SequenceDelta) -> list[dict[str, Any]]:
    """Chat `logprobs.content` entries of a delta's tokens."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = d.top_logprobs or [[] for _ in d.token_ids]
    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
            for t, lp, top in zip(d.token_ids, d.logprobs or [], tops, strict=True)]


async def collect(request: Request, stream: OutputStream, on_delta: Callable[[SequenceDelta], None]) -> bool:
    """Feeds every delta of a non-streamed request to `on_delta`. Returns False, having aborted
    the request, if the client disconnects first; raises EngineError if the engine fails it."""
    async def consume() -> None:
        async for deltas in stream:
            for d in deltas:
                on_delta(d)

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        consumer.cancel()
        stream.close()
    if not consumer.done() or consumer.cancelled():
        log.info("client disconnected; aborted %s", stream.id)
        return False
    consumer.result()
    return True


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
