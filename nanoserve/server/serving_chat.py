"""POST /v1/chat/completions: messages through the chat template, one engine request of n samples.

Stream shape (OpenAI's): per choice a first chunk with the role, then content chunks, then a
chunk with an empty delta and the finish_reason; with include_usage a final chunk with empty
choices and the usage; then [DONE]. An engine failure mid-stream is an error event, then [DONE].

With a reasoning parser (`--reasoning-parser`, or read from the chat template), the text of the
think block goes to `reasoning_content` (`delta.reasoning_content` in a stream), the rest to
`content`, and an output constraint (response_format, guided_*, a forced tool call) applies to
the answer after the think block (`reasoning_grammar`). With `tools` (tool_choice "auto", or
"required" or a named function, which force the call through a grammar: see `forced_tools`; on a
model with no tool-call format a forced call is a JSON array of calls, read by `JsonListParser`), the
tools are rendered into the prompt by the chat template and each choice's content goes through
the model's tool-call parser (`tool_parsers`): content chunks carry only the text outside calls;
a call streams as OpenAI's do, a first chunk with its id and name, then chunks of argument text
with the same `tool_calls[0].index` (counting the choice's calls); a choice that called tools ends
with finish_reason "tool_calls" (unless it ran out of tokens). With `parallel_tool_calls` false a
choice returns its first call only (forced calls: the grammar allows one). See `chat_output`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams, resolve_bad_words, resolve_prediction
from nanoserve.runtime.async_engine import EngineError, OutputStream
from nanoserve.runtime.engine_core import EngineInfo
from nanoserve.server.chat.forced_tools import forced_json_calls, forced_tool_calls
from nanoserve.server.chat.output import ChatOutputFormat, tool_call_chunks
from nanoserve.server.chat.reasoning_grammar import after_reasoning
from nanoserve.server.chat.reasoning_parsers import closed_before_reply, starts_in_reasoning
from nanoserve.server.chat.tool_parsers.json_list import JsonListParser
from nanoserve.server.protocol import sse
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.openai import ChatCompletionRequest
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


async def prepare_chat(serving: Serving, info: EngineInfo,
                       body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
    """Prompt ids (the template rendered and tokenized in the prompt workers) and sampling params;
    max_tokens defaults to the rest of the context (or of the KV pool, if smaller)."""
    tok = info.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    ids = await render_chat(serving, info, body)
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        max_tokens = max(info.limits.max_tokens_in_pool - len(ids), 1)
    params = body.sampling_params(max_tokens, body.requested_logprobs(), info.sampling_defaults)
    resolve_bad_words(params, tok)
    resolve_prediction(params, tok)
    validate_prompt(info.limits, ids, params, "messages")
    return ids, params


async def render_chat(serving: Serving, info: EngineInfo, body: ChatCompletionRequest) -> list[int]:
    """The prompt ids of a chat request: its messages and tools through the chat template, rendered
    and tokenized in the prompt workers (a 400 naming `messages` for what the template refuses or
    for a conversation too long to fit)."""
    tok = info.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer")
    return await serving.prompts.encode_chat(tok, info.limits, [m.to_template() for m in body.messages],
                                             add_generation_prompt=body.add_generation_prompt is not False,
                                             tools=body.template_tools(), **body.template_kwargs())


# Prompt tokens read to see whether the template left a think block open (or closed it empty).
_PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ChatRun:
    """A chat request started in the engine: its output stream, the tokenizer and sampling params it
    runs with, and how each choice's text is parsed (`output`: reasoning, content, tool calls). The
    other chat-shaped APIs (Responses, Anthropic Messages) start theirs here and only write their
    own wire format."""

    stream: OutputStream
    tok: Tokenizer
    params: SamplingParams
    output: ChatOutputFormat


async def start_chat(serving: Serving, body: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> ChatRun:
    """Checks the request and whether the queue has room for it (a 429 before any work), renders and
    tokenizes it (in the prompt workers), builds its constraint (forced tool calls, response format,
    after a think block) and submits it; raises APIError (a 400 before anything runs) for what
    cannot run."""
    serving.check_request(body, body.model)
    serving.admit(body.n or 1)
    info = serving.running_info()
    tok = serving.tokenizer()
    forced = body.forced_tools()
    tools = serving.tool_parser(tok, forced is not None) if body.template_tools() is not None else None
    reasoning = serving.reasoning_format(tok)
    ids, params = await prepare_chat(serving, info, body)
    if tools is not None and tools.needs_special_tokens and body.skip_special_tokens is None:
        params.skip_special_tokens = False  # the format's markers are special tokens
    if forced is not None:
        assert tools is not None  # a forced call comes with tools, and tools with a parser
        parallel = body.parallel_tool_calls is not False
        calls = (forced_json_calls(forced, parallel) if tools is JsonListParser
                 else forced_tool_calls(tools, forced, parallel, tok))
        params = dataclasses.replace(params, structured=calls)
    constraint = body.structured()
    param = "tool_choice" if constraint is None else constraint[0]
    await serving.grammars.check(tok, params, param)
    tail = tok.decode(ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    in_reasoning = reasoning is not None and starts_in_reasoning(reasoning, tail)
    if reasoning is not None and params.structured is not None and not closed_before_reply(tail):
        # the constraint applies to the answer after the think block
        params = dataclasses.replace(params, structured=after_reasoning(params.structured, tok, in_reasoning))
        await serving.grammars.check(tok, params, param)
    output = ChatOutputFormat(tools, reasoning is not None, in_reasoning, body.parallel_tool_calls is not False)
    return ChatRun(serving.submit([ids], params, body.priority or 0, id_prefix), tok, params, output)


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    run = await start_chat(serving, body)
    if body.stream:
        events = _events(serving, run.stream, run.tok, run.params.n, body.include_usage, run.output)
        return sse.SSEResponse(events, on_close=run.stream.close, keep_alive_s=serving.keep_alive_s)
    return await _complete(serving, run.stream, run.tok, run.params.n, request, run.output)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


async def _complete(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int, request: Request,
                    output: ChatOutputFormat) -> Response:
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
    messages = [output.message("".join(c.text)) for c in choices]
    return JSONResponse({
        "id": stream.id, "object": "chat.completion", "created": now_s(), "model": serving.model_name,
        "choices": [{"index": i, "message": m, "logprobs": None if c.logprobs is None else {"content": c.logprobs},
                     "finish_reason": _finish_reason(c.finish_reason, "tool_calls" in m)}
                    for i, (c, m) in enumerate(zip(choices, messages, strict=True))],
        "usage": usage.body(),
    })


async def _events(serving: Serving, stream: OutputStream, tok: Tokenizer, n: int, include_usage: bool,
                  output: ChatOutputFormat) -> AsyncGenerator[bytes, None]:
    base: dict[str, Any] = {"id": stream.id, "object": "chat.completion.chunk", "created": now_s(),
                            "model": serving.model_name}
    usage_field = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], logprobs: list[Any] | None = None,
              finish_reason: str | None = None) -> bytes:
        content = None if logprobs is None else {"content": logprobs}
        choice = {"index": index, "delta": delta, "logprobs": content, "finish_reason": finish_reason}
        return sse.event({**base, "choices": [choice], **usage_field})

    usage = UsageTally()
    parsers = [output.parser() for _ in range(n)]
    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for deltas in stream:
            for d in deltas:
                usage.add(d)
                logprobs = chat_logprobs(tok, d) if d.logprobs is not None else None
                parser = parsers[d.index]
                reasoning, text, calls = parser.push(d.text)
                if d.finished:
                    last = parser.finish()
                    reasoning, text, calls = reasoning + last.reasoning, text + last.content, calls + last.calls
                delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
                if text or logprobs:
                    delta["content"] = text
                if delta:
                    yield chunk(d.index, delta, logprobs)
                for tool_calls in tool_call_chunks(calls):
                    yield chunk(d.index, {"tool_calls": tool_calls})
                if d.finished:
                    yield chunk(d.index, {}, finish_reason=_finish_reason(d.finish_reason, parser.num_calls > 0))
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": usage.body()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE
