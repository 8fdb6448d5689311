"""POST /v1/chat/completions: messages through the chat template, one engine request of n samples.

Stream shape (OpenAI's): per choice a first chunk with the role, then content chunks, then a
chunk with an empty delta and the finish_reason; with include_usage a final chunk with empty
choices and the usage; then [DONE]. An engine failure mid-stream is an error event, then [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.llm_engine import LLMEngine, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.server import sse
from nanoserve.server.async_engine import EngineError, OutputStream
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
from nanoserve.tokenizer import Tokenizer


def prepare_chat(engine: LLMEngine, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling params; max_tokens defaults to the rest of the context (or of the
    KV pool, if smaller). Blocking (template + tokenizer), so handlers run it in a worker thread."""
    tok = engine.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    messages = [m.to_template() for m in body.messages]
    try:
        ids = tok.encode_chat(messages, add_generation_prompt=body.add_generation_prompt is not False)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        capacity = min(engine.max_model_len, engine.num_blocks * engine.kv.block_size)
        max_tokens = max(capacity - len(ids), 1)
    params = body.sampling_params(max_tokens, body.requested_logprobs())
    validate_prompt(engine, ids, params, "messages")
    return ids, params


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    engine = serving.running_engine()
    tok = serving.tokenizer()
    ids, params = await asyncio.to_thread(prepare_chat, engine, body)
    stream = serving.submit([ids], params, body.priority or 0, "chatcmpl")
    if body.stream:
        events = _events(serving, stream, tok, params.n, body.include_usage)
        return sse.SSEResponse(events, on_close=stream.close)
    return await _complete(serving, stream, tok, params.n, request)


async def _complete(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int,
                    request: Request) -> Response:
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
    return JSONResponse({
        "id": stream.id, "object": "chat.completion", "created": now_s(), "model": serving.model_name,
        "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                     "logprobs": None if c.logprobs is None else {"content": c.logprobs},
                     "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
        "usage": usage.body(),
    })


async def _events(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int,
                  include_usage: bool) -> AsyncGenerator[bytes, None]:
    base: dict[str, Any] = {"id": stream.id, "object": "chat.completion.chunk", "created": now_s(),
                            "model": serving.model_name}
    usage_field = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], logprobs: list[Any] | None = None,
              finish_reason: str | None = None) -> bytes:
        content = None if logprobs is None else {"content": logprobs}
        choice = {"index": index, "delta": delta, "logprobs": content, "finish_reason": finish_reason}
        return sse.event({**base, "choices": [choice], **usage_field})

    usage = UsageTally()
    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for deltas in stream:
            for d in deltas:
                usage.add(d)
                logprobs = chat_logprobs(tok, d) if d.logprobs is not None else None
                if d.text or logprobs:
                    yield chunk(d.index, {"content": d.text}, logprobs)
                if d.finished:
                    yield chunk(d.index, {}, finish_reason=d.finish_reason)
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": usage.body()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE
