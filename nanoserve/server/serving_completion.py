"""POST /v1/completions: one engine request per prompt (a string, token ids, or a list of either),
each with n samples; choice `i * n + j` is sample j of prompt i.

Stream shape: a `text_completion` chunk per engine step that gave a choice tokens (its text delta
may be empty: tokens whose bytes complete no character yet, text held back while it may begin a stop
string, a random-weight model's padding ids; as vLLM and llama-server stream them, so a client sees
the first token when it is made), then per choice a chunk with empty text and the finish_reason
(the step that finishes a choice gives a chunk before it only with text or logprobs); with
include_usage a final chunk with empty choices and the usage; then [DONE]. With `echo` each choice's
first chunk is its prompt.

With `prompt_logprobs=k` (vLLM's field; not with streaming), every choice carries its prompt's
`prompt_logprobs`: None for the first token, then per prompt token a map from token id (as a
string) to `{logprob, rank, decoded_token}` holding that token and the k most likely ones.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import PromptLogprob, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams, resolve_bad_words, resolve_prediction
from nanoserve.runtime.async_engine import EngineError, OutputStream
from nanoserve.runtime.engine_core import EngineInfo
from nanoserve.server.protocol import sse
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.openai import CompletionRequest
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


async def prepare_completion(serving: Serving, info: EngineInfo, tok: Tokenizer,
                             body: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
    """Prompt ids (text tokenized in the prompt workers) and sampling params."""
    ids = [await serving.prompts.encode(tok, info.limits, p, "prompt") if isinstance(p, str) else list(p)
           for p in body.prompts()]
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = body.sampling_params(max_tokens, body.logprobs, info.sampling_defaults)
    if params.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not supported with streaming", param="prompt_logprobs")
    resolve_bad_words(params, tok)
    resolve_prediction(params, tok)
    for prompt_ids in ids:
        validate_prompt(info.limits, prompt_ids, params, "prompt")
    return ids, params


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    serving.admit(len(body.prompts()) * (body.n or 1))
    info = serving.running_info()
    tok = serving.tokenizer()
    ids, params = await prepare_completion(serving, info, tok, body)
    constraint = body.structured()
    await serving.grammars.check(tok, params, None if constraint is None else constraint[0])
    echo = [p if isinstance(p, str) else tok.decode(p) for p in body.prompts()] if body.echo else None
    stream = serving.submit(ids, params, body.priority or 0, "cmpl")
    choice_of = {rid: i * params.n for i, rid in enumerate(stream.request_ids)}
    if body.stream:
        events = _events(serving, stream, tok, choice_of, params.n, echo, body.include_usage)
        return sse.SSEResponse(events, on_close=stream.close, keep_alive_s=serving.keep_alive_s)
    return await _complete(serving, stream, tok, choice_of, params.n, echo, request)


def _entries(tok: Tokenizer, d: SequenceDelta) -> list[_Entry]:
    tops = d.top_logprobs or [[] for _ in d.token_ids]
    return [(token_text(tok, t), lp, {token_text(tok, i): v for i, v in top})
            for t, lp, top in zip(d.token_ids, d.logprobs or [], tops, strict=True)]


def prompt_logprobs_body(tok: Tokenizer, entries: list[PromptLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {id: {logprob,
    rank, decoded_token}} for the token itself and the most likely ones (rank 1 = the likeliest)."""
    def entry(e: PromptLogprob | None) -> dict[str, Any] | None:
        if e is None:
            return None
        out = {str(t): {"logprob": lp, "rank": rank + 1, "decoded_token": token_text(tok, t)}
               for rank, (t, lp) in enumerate(e.top)}
        out[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": token_text(tok, e.token_id)}
        return out

    return [entry(e) for e in entries]


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
    prompt_logprobs: dict[int, list[dict[str, Any] | None]] = {}  # by the request's first choice

    def on_delta(d: SequenceDelta) -> None:
        usage.add(d)
        entries = _entries(tok, d) if d.logprobs is not None else None
        choices[choice_of[d.request_id] + d.index].add(d, entries)
        if d.prompt_logprobs is not None:
            prompt_logprobs[choice_of[d.request_id]] = prompt_logprobs_body(tok, d.prompt_logprobs)

    try:
        if not await collect(request, stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    return JSONResponse({
        "id": stream.id, "object": "text_completion", "created": now_s(), "model": serving.model_name,
        "choices": [{"index": i, "text": (echo[i // n] if echo else "") + "".join(c.text),
                     "logprobs": None if c.logprobs is None else _logprobs(c.logprobs, 0),
                     "finish_reason": c.finish_reason,
                     **({"prompt_logprobs": prompt_logprobs.get(i - i % n)} if prompt_logprobs else {})}
                    for i, c in enumerate(choices)],
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
                if d.text or logprobs or (d.token_ids and not d.finished):
                    yield chunk(index, d.text, logprobs)
                if d.finished:
                    yield chunk(index, "", finish_reason=d.finish_reason)
        if include_usage:
            yield sse.event({**base, "choices": [], "usage": usage.body()})
    except Exception as e:
        yield sse.event(stream_error(e))
    yield sse.DONE
