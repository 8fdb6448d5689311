"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat path.

A request is translated into a chat completion request (`protocol.anthropic`), started by
`serving_chat.start_chat` and its one reply written in Anthropic's wire format. The reply's text
goes through the chat output parsers (`chat.output`) and becomes content blocks (`ContentBlocks`):
`thinking` (the think block, with a reasoning parser), `text`, and a `tool_use` per call (with
tools). A stream's blocks follow the text (text written between two calls is a block between
them); a non-streamed reply, parsed whole, has its thinking, then all its text in one block, then
its calls. Thinking blocks carry an empty `signature`: nanoserve signs
nothing. A call cut short by `max_tokens` keeps the arguments text generated so far in a stream's
`input_json_delta`s; a non-streamed one, whose `input` must be an object, gets `{}`.

`stop_reason`: `max_tokens` when the token bound cut the reply, else `tool_use` when it called a
tool, else `stop_sequence` (and `stop_sequence` set) when one of `stop_sequences` ended it, else
`end_turn`. `usage` counts the rendered prompt's tokens (`input_tokens`) and the generated ones.

Stream (`event: <type>` then `data: <json>` per event): `message_start` (once the prompt is
counted, with the first output), then per block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`; then `message_delta` (stop_reason,
stop_sequence, usage.output_tokens) and `message_stop`. A failure mid-stream ends it with an
`error` event in Anthropic's error shape.

`count_tokens` renders the same prompt (messages, system, tools, thinking) through the chat
template and counts its tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import SequenceDelta
from nanoserve.runtime.async_engine import EngineError
from nanoserve.server.chat.output import ChoiceDelta
from nanoserve.server.protocol import sse
from nanoserve.server.protocol.anthropic import CountTokensRequest, MessagesRequest
from nanoserve.server.protocol.errors import ANTHROPIC_PATH
from nanoserve.server.serving import Serving, collect, engine_error, stream_error
from nanoserve.server.serving_chat import ChatRun, render_chat, start_chat


def _template_kwargs(serving: Serving, body: CountTokensRequest) -> dict[str, Any]:
    tok = serving.tokenizer()
    reads = "enable_thinking" in (tok.chat_template or "")
    return body.thinking_kwargs(reads, serving.reasoning_format(tok) is not None)


async def create_message(serving: Serving, body: MessagesRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    chat = body.to_chat_request(_template_kwargs(serving, body))
    run = await start_chat(serving, chat, "msg")
    stops = StopSequences(body.stop_sequences or [])
    if body.stream:
        return sse.SSEResponse(_events(serving, run, stops), on_close=run.stream.close,
                               keep_alive_s=serving.keep_alive_s)
    return await _complete(serving, run, stops, request)


async def count_tokens(serving: Serving, body: CountTokensRequest) -> JSONResponse:
    serving.check_request(body, body.model)
    chat = body.to_chat(_template_kwargs(serving, body))
    ids = await render_chat(serving, serving.running_info(), chat)
    return JSONResponse({"input_tokens": len(ids)})


@dataclass(slots=True)
class StopSequences:
    """Which of the request's stop sequences ended the reply, cut off its text. The engine keeps a
    matched stop string at the end of the text, whole in the sequence's last delta (it holds back
    any suffix that could still become one), so the last delta's text ends with it."""

    stops: list[str]
    text: str = ""  # the reply's text so far, stop sequence included
    matched: str | None = None

    def cut(self, d: SequenceDelta) -> str:
        self.text += d.text
        if d.finish_reason != "stop" or not self.stops:
            return d.text
        ends = [s for s in self.stops if self.text.endswith(s)]
        if not ends:
            return d.text
        self.matched = max(ends, key=len)  # the engine matches the earliest-starting, longest one
        return d.text[: len(d.text) - len(self.matched)]


def _stop_reason(finish_reason: str | None, called: bool, stops: StopSequences) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stops.matched is not None else "end_turn"


_DELTA_FIELDS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
                 "tool_use": ("input_json_delta", "partial_json")}


@dataclass(slots=True)
class ContentBlocks:
    """A reply's content blocks, built from its parsed deltas; each call returns the stream
    events it makes. Invariant: only the last block may be open (`open`), and the events name
    blocks by their index in `blocks`."""

    blocks: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False
    arguments: str = ""  # the open tool_use block's arguments text

    def add(self, part: ChoiceDelta) -> list[dict[str, Any]]:
        """A delta's events in the order the text made them: its reasoning, then the rest of the
        arguments of a call already open (text cannot come inside a call), its text, and the calls
        it begins (text before a call comes before it)."""
        begun = next((k for k, c in enumerate(part.calls) if c.name is not None), len(part.calls))
        events = self._extend("thinking", part.reasoning)
        for call in part.calls[:begun]:
            events += self._extend("tool_use", call.arguments)
        events += self._extend("text", part.content)
        for call in part.calls[begun:]:
            if call.name is not None:
                events += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                       "name": call.name, "input": {}})
            events += self._extend("tool_use", call.arguments)
        return events

    def close(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            try:
                arguments = json.loads(self.arguments or "{}")
            except json.JSONDecodeError:
                arguments = {}  # cut short by max_tokens
            block["input"] = arguments if isinstance(arguments, dict) else {}
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self.open, self.arguments = True, ""
        start = {**block, "input": {}} if block["type"] == "tool_use" else {**block, block["type"]: ""}
        return [*events, {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _extend(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if not self.open or self.blocks[-1]["type"] != kind:
            assert kind != "tool_use", "a call's arguments follow its name"
            empty: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            events = self._start(empty)
        if kind == "tool_use":
            self.arguments += text
        else:
            self.blocks[-1][kind] += text
        delta_type, key = _DELTA_FIELDS[kind]
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": delta_type, key: text}}]


def _message(serving: Serving, run: ChatRun, content: list[dict[str, Any]], stop_reason: str | None,
             stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"id": run.stream.id.replace("-", "_", 1), "type": "message", "role": "assistant",
            "model": serving.model_name, "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


async def _complete(serving: Serving, run: ChatRun, stops: StopSequences, request: Request) -> Response:
    texts: list[str] = []
    last: list[SequenceDelta] = []
    output_tokens = 0

    def on_delta(d: SequenceDelta) -> None:
        nonlocal output_tokens
        output_tokens += len(d.token_ids)
        texts.append(stops.cut(d))
        last[:] = [d]

    try:
        if not await collect(request, run.stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    parser, blocks = run.output.parser(), ContentBlocks()
    blocks.add(parser.push("".join(texts)))
    blocks.add(parser.finish())
    blocks.close()
    finish_reason, input_tokens = (last[0].finish_reason, last[0].num_prompt_tokens) if last else (None, 0)
    reason = _stop_reason(finish_reason, blocks.called, stops)
    return JSONResponse(_message(serving, run, blocks.blocks, reason, stops.matched if reason == "stop_sequence"
                                 else None, input_tokens, output_tokens))


async def _events(serving: Serving, run: ChatRun, stops: StopSequences) -> AsyncGenerator[bytes, None]:
    def emit(payload: dict[str, Any]) -> bytes:
        return sse.named_event(payload["type"], payload)

    parser, blocks = run.output.parser(), ContentBlocks()
    started, output_tokens = False, 0
    try:
        async for deltas in run.stream:
            for d in deltas:
                if not started:
                    started = True
                    yield emit({"type": "message_start",
                                "message": _message(serving, run, [], None, None, d.num_prompt_tokens, 0)})
                output_tokens += len(d.token_ids)
                events = blocks.add(parser.push(stops.cut(d)))
                if d.finished:
                    events += blocks.add(parser.finish()) + blocks.close()
                for e in events:
                    yield emit(e)
                if d.finished:
                    reason = _stop_reason(d.finish_reason, blocks.called, stops)
                    yield emit({"type": "message_delta",
                                "delta": {"stop_reason": reason,
                                          "stop_sequence": stops.matched if reason == "stop_sequence" else None},
                                "usage": {"output_tokens": output_tokens}})
                    yield emit({"type": "message_stop"})
    except Exception as e:
        yield sse.named_event("error", stream_error(e, ANTHROPIC_PATH))
