"""POST /v1/completions: one engine request per prompt (a string, token ids, or a list of either),
each with n samples; choice `i * n + j` is sample j of prompt i.

Stream shape: `text_completion` chunks with text deltas, then per choice a chunk with empty text
and the finish_reason; with include_usage a final chunk with empty choices and the usage; then
[DONE]. With `echo` each choice's first chunk is its prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.server import sse
from nanoserve.server.async_engine import EngineError, OutputStream
from nanoserve.server.engine_core import EngineInfo
from nanoserve.server.protocol import CompletionRequest
from nanoserve.server.serving import (
    ChoiceOutput,
    Serving,
    UsageTally,
    collect,
    engine_error,
    now_s,
    stream_error,
    token_text,
    validate_prompt,
)
from nanoserve.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

_Entry = tuple[str, float, dict[str, float]]  # token text, its logprob, the top tokens' logprobs


def prepare_completion(info: EngineInfo, tok: Tokenizer,
                       body: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
    """Prompt ids and sampling params. Blocking (tokenizer), so handlers run it in a worker thread."""
    ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = body.sampling_params(max_tokens, body.logprobs)
    for prompt_ids in ids:
        validate_prompt(info.limits, prompt_ids, params, "prompt")
    return ids, params


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    info = serving.running_info()
    tok = serving.tokenizer()
    ids, params = await asyncio.to_thread(prepare_completion, info, tok, body)
    constraint = body.structured()
    await serving.grammars.check(tok, params, None if constraint is None else constraint[0])
    echo = [p if isinstance(p, str) else tok.decode(p) for p in body.prompts()] if body.echo else None
    stream = serving.submit(ids, params, body.priority or 0, "cmpl")
    choice_of = {rid: i * params.n for i, rid in enumerate(stream.request_ids)}
    if body.stream:
        events = _events(serving, stream, tok, choice_of, params.n, echo, body.include_usage)
        return sse.SSEResponse(events, on_close=stream.close)
    return await _complete(serving, stream, tok, choice_of, params.n, echo, request)


def _entries(tok: Tokenizer, d: SequenceDelta) -> list[_Entry]:
    tops = d.top_logprobs or [[] for _ in d.token_ids]
    return [(token_text(tok, t), lp, {token_text(tok, i): v for i, v in top})
            for t, lp, top in zip(d.token_ids, d.logprobs or [], tops, strict=True)]


def _logprobs(entries: list[_Entry], offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object; `text_offset` counts from `offset`."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries], "text_offset": offsets}


async def _complete(serving: Serving, stream: OutputStream, tok: Tokenizer, choice_of: dict[str, int], n: int,
                    echo: list[str] | None, request: Request) -> Response:
    choices = [ChoiceOutput() for _ in range(len(choice_of) * n)]
    usage = UsageTally()

    def on_delta(d: SequenceDelta) -> None:
        usage.add(d)
        entries = _entries(tok, d) if d.logprobs is not None else None
        choices[choice_of[d.request_id] + d.index].add(d, entries)

    try:
        if not await collect(request, stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    return JSONResponse({
        "id": stream.id, "object": "text_completion", "created": now_s(), "model": serving.model_name,
        "choices": [{"index": i, "text": (echo[i // n] if echo else "") + "".join(c.text),
                     "logprobs": None if c.logprobs is None else _logprobs(c.logprobs, 0),
                     "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
        "usage": usage.body(),
    })


async def _events(serving: Serving, stream: OutputStream, tok: Tokenizer, choice_of: dict[str, int], n: int,
                  echo: list[str] | None, include_usage: bool) -> AsyncGenerator[bytes, None]:
    base: dict[str, Any] = {"id": stream.id, "object": "text_completion", "created": now_s(),
                            "model": serving.model_name}
    usage_field = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None = None,
              finish_reason: str | None = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse.event({**base, "choices": [choice], **usage_field})

    offsets = [0] * (len(choice_of) * n)
    usage = UsageTally()
    try:
        for i in range(len(offsets) if echo else 0):
            yield chunk(i, echo[i // n])  # type: ignore[index]
        async for deltas in stream:
            for d in deltas:
                usage.add(d)
                index = choice_of[d.request_id] + d.index
                logprobs = None
                if d.logprobs is not None:
                    entries = _entries(tok, d)
                    logprobs = _logprobs(entries, offsets[index])
                    offsets[index] += sum(len(e[0]) for e in entries)
                if d.text or logprobs:
                    yield chunk(index, d.text, logprobs)
                if d.finished:
                    yield chunk(index, "", finish_reason=d.finish_reason)
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": usage.body()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE
