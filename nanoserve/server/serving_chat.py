"""POST /v1/chat/completions: messages through the chat template, one engine request of n samples.

Stream shape (OpenAI's): per choice a first chunk with the role, then content chunks, then a
chunk with an empty delta and the finish_reason; with include_usage a final chunk with empty
choices and the usage; then [DONE]. An engine failure mid-stream is an error event, then [DONE].

With `tools` (and tool_choice "auto"), the tools are rendered into the prompt by the chat template
and each choice's text goes through the model's tool-call parser (`tool_parsers`): content chunks
carry only the text outside calls, each complete call is one chunk with the whole call (its
`tool_calls[0].index` counting the choice's calls), and a choice that called tools ends with
finish_reason "tool_calls" (unless it ran out of tokens).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams, resolve_bad_words
from nanoserve.server import sse
from nanoserve.server.async_engine import EngineError, OutputStream
from nanoserve.server.engine_core import EngineInfo
from nanoserve.server.errors import APIError
from nanoserve.server.protocol import ChatCompletionRequest
from nanoserve.server.serving import (
    ChoiceOutput,
    Serving,
    UsageTally,
    chat_logprobs,
    collect,
    engine_error,
    now_s,
    stream_error,
    validate_prompt,
)
from nanoserve.server.tool_parsers import ToolCall, ToolCallParser
from nanoserve.tokenizer import Tokenizer


def prepare_chat(info: EngineInfo, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling params; max_tokens defaults to the rest of the context (or of the
    KV pool, if smaller). Blocking (template + tokenizer), so handlers run it in a worker thread."""
    tok = info.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    messages = [m.to_template() for m in body.messages]
    try:
        ids = tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt is not False,
                              tools=body.template_tools())
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = max(info.limits.max_tokens_in_pool - len(ids), 1)
    params = body.sampling_params(max_tokens, body.requested_logprobs(), info.sampling_defaults)
    resolve_bad_words(params, tok)
    validate_prompt(info.limits, ids, params, "messages")
    return ids, params


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    info = serving.running_info()
    tok = serving.tokenizer()
    parser = serving.tool_parser(tok) if body.template_tools() is not None else None
    ids, params = await asyncio.to_thread(prepare_chat, info, body)
    stream = serving.submit([ids], params, body.priority or 0, "chatcmpl")
    if body.stream:
        events = _events(serving, stream, tok, params.n, body.include_usage, parser)
        return sse.SSEResponse(events, on_close=stream.close, keep_alive_s=serving.keep_alive_s)
    return await _complete(serving, stream, tok, params.n, request, parser)


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    """A call as the API carries it, with a fresh id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _message(text: str, parser: Callable[[], ToolCallParser] | None) -> dict[str, Any]:
    if parser is None:
        return {"role": "assistant", "content": text}
    p = parser()
    content, calls = p.push(text)
    rest, more = p.finish()
    content, calls = content + rest, calls + more
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": [tool_call_body(c) for c in calls]}


async def _complete(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int, request: Request,
                    parser: Callable[[], ToolCallParser] | None) -> Response:
    choices = [ChoiceOutput() for _ in range(n)]
    usage = UsageTally()

    def on_delta(d: SequenceDelta) -> None:
        usage.add(d)
        choices[d.index].add(d, chat_logprobs(tok, d) if d.logprobs is not None else None)

    try:
        if not await collect(request, stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    messages = [_message("".join(c.text), parser) for c in choices]
    return JSONResponse({
        "id": stream.id, "object": "chat.completion", "created": now_s(), "model": serving.model_name,
        "choices": [{"index": i, "message": m, "logprobs": None if c.logprobs is None else {"content": c.logprobs},
                     "finish_reason": _finish_reason(c.finish_reason, "tool_calls" in m)}
                    for i, (c, m) in enumerate(zip(choices, messages, strict=True))],
        "usage": usage.body(),
    })


async def _events(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int, include_usage: bool,
                  parser: Callable[[], ToolCallParser] | None) -> AsyncGenerator[bytes, None]:
    base: dict[str, Any] = {"id": stream.id, "object": "chat.completion.chunk", "created": now_s(),
                            "model": serving.model_name}
    usage_field = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], logprobs: list[Any] | None = None,
              finish_reason: str | None = None) -> bytes:
        content = None if logprobs is None else {"content": logprobs}
        choice = {"index": index, "delta": delta, "logprobs": content, "finish_reason": finish_reason}
        return sse.event({**base, "choices": [choice], **usage_field})

    usage = UsageTally()
    parsers = [parser() for _ in range(n)] if parser is not None else None
    num_calls = [0] * n

    def calls_chunk(index: int, calls: list[ToolCall]) -> bytes:
        tool_calls = [{"index": num_calls[index] + j, **tool_call_body(c)} for j, c in enumerate(calls)]
        num_calls[index] += len(calls)
        return chunk(index, {"tool_calls": tool_calls})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for deltas in stream:
            for d in deltas:
                usage.add(d)
                logprobs = chat_logprobs(tok, d) if d.logprobs is not None else None
                text = d.text
                calls: list[ToolCall] = []
                if parsers is not None:
                    text, calls = parsers[d.index].push(d.text)
                    if d.finished:
                        rest, more = parsers[d.index].finish()
                        text, calls = text + rest, calls + more
                if text or logprobs:
                    yield chunk(d.index, {"content": text}, logprobs)
                if calls:
                    yield calls_chunk(d.index, calls)
                if d.finished:
                    yield chunk(d.index, {}, finish_reason=_finish_reason(d.finish_reason, num_calls[d.index] > 0))
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": usage.body()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE
