"""POST /v1/responses (OpenAI's Responses API) on the chat machinery; GET and DELETE of stored ones.

A request becomes a `ChatCompletionRequest` (`chat_request`): `instructions` as a system message,
then the stored conversation of `previous_response_id`, then the input items (messages; assistant
`function_call` items as the assistant turn's `tool_calls`; `function_call_output` items as tool
messages; reasoning items as the next assistant turn's `reasoning_content`). Function tools are
flattened in Responses and nested in chat; `text.format` is chat's `response_format`;
`reasoning.effort` switches thinking through the chat template's `enable_thinking` where the
template reads it (see `_thinking`). It runs through `start_chat` (one sample: Responses has no n).

The reply's text goes through the chat output parser and then `OutputItems`, which builds the
output items (reasoning, message, function_call, in the order the model writes them) and the
stream's events in one pass; a non-streamed response is built by the same code from the same
deltas, so it equals what a stream's events describe. Stream shape (OpenAI's): `event: <type>`
and `data: <json>` per event, each with a `sequence_number` counting from 0: response.created,
response.in_progress, per item output_item.added, (content_part.added, text deltas, text done,
content_part.done) or (function_call_arguments.delta..., .done), output_item.done; then
response.completed, or response.incomplete when max_output_tokens cut it; no [DONE]. An engine
failure mid-stream is an `error` event and ends the stream.

Responses are stateless unless `store: true`; stored ones (their bodies, input items and the
conversations that `previous_response_id` continues) live in the app's `ResponseStore`, in memory
only.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from nanoserve.engine.outputs import SequenceDelta
from nanoserve.runtime.async_engine import EngineError
from nanoserve.server.chat.output import ChoiceDelta, ChoiceParser, call_id
from nanoserve.server.chat.tool_parsers.calls import ToolCallDelta
from nanoserve.server.protocol import sse
from nanoserve.server.protocol.errors import UNSUPPORTED_FIELD, APIError, invalid_request
from nanoserve.server.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolDefinition,
)
from nanoserve.server.protocol.responses import (
    ENCRYPTED_REASONING,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunctionChoice,
    ReasoningItem,
    ResponsesRequest,
)
from nanoserve.server.response_store import ResponseStore, StoredResponse
from nanoserve.server.serving import Serving, UsageTally, collect, engine_error, stream_error
from nanoserve.server.serving_chat import ChatRun, start_chat

_ITEMS = TypeAdapter(list[InputItem])
# Chat's names of the fields a Responses request sets under other names, for the 400s start_chat raises.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
           "chat_template_kwargs": "reasoning.effort"}
_NO_THINKING = ("none", "minimal")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive assistant text and function_call items form one
    assistant turn (content, then tool_calls), a reasoning item's text is the next assistant turn's
    `reasoning_content`. A call whose arguments are not JSON is a 400 naming it."""
    messages: list[dict[str, Any]] = []
    reasoning = ""

    def assistant(content: str | None) -> dict[str, Any]:
        nonlocal reasoning
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
        return message

    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
        elif isinstance(item, MessageItem):
            if item.role == "assistant":
                assistant(item.text())
            else:
                messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except json.JSONDecodeError as e:
                raise APIError(400, f"function_call arguments are not valid JSON: {e}",
                               param=f"input.{i}.arguments") from e
            last = messages[-1] if messages and messages[-1]["role"] == "assistant" and not reasoning else None
            turn = last if last is not None else assistant(None)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def _thinking(body: ResponsesRequest, reasoning_format: str | None, template: str | None) -> dict[str, Any]:
    """`reasoning.effort` as chat template kwargs: "none"/"minimal" turn thinking off, the other
    levels on, through `enable_thinking` where the template reads it (Qwen3's); the levels above
    "minimal" are not told apart (the model thinks as long as it does). A model without reasoning,
    or one whose template cannot turn it off, gets a 400 for what it cannot do."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is None:
        return {}
    if reasoning_format is None:
        raise APIError(400, "this model does not reason: reasoning.effort is not supported", param="reasoning.effort")
    if "enable_thinking" in (template or ""):
        return {"enable_thinking": effort not in _NO_THINKING}
    if effort in _NO_THINKING:
        raise APIError(400, f"this model's chat template cannot turn reasoning off (effort '{effort}')",
                       param="reasoning.effort")
    return {}


def _input_items(body: ResponsesRequest) -> Sequence[InputItem]:
    return [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]],
                 thinking: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request that runs `body` after the stored conversation `history`."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += history + chat_messages(_input_items(body))
    if not messages:
        raise APIError(400, "the input is empty", param="input")
    tools = [ToolDefinition(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in body.tools or []]
    named = body.tool_choice
    choice = (NamedToolChoice(type="function", function=NamedFunction(name=named.name))
              if isinstance(named, NamedFunctionChoice) else named)
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text.format.schema")
        schema = (JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
                  if fmt.type == "json_schema" else None)
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    try:
        return ChatCompletionRequest(
            model=body.model, n=None, seed=None, messages=[ChatMessage.model_validate(m) for m in messages],
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
            tools=tools or None, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
            response_format=response_format, chat_template_kwargs=thinking or None, user=body.user)
    except ValidationError as e:
        raise invalid_request(e.errors()) from e


@dataclass(slots=True)
class OutputItems:
    """The output items of one reply, built from its parsed deltas, and the stream events that
    describe the building. Invariants: at most one item is open (the last); text goes to the
    open item of its kind or opens a new one, closing the open one; every item that was added is
    done once `finish` has run; a complete reply has a message or a function call (an empty
    message if the model wrote neither). Within one delta the parsers give content and calls
    apart, so the arguments that continue the call open at its start go first, then the content,
    then the calls it starts (text between two calls started in one delta comes before both)."""

    encrypted_reasoning: bool = False  # reasoning items carry their text in `encrypted_content` too
    items: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False
    calls: dict[int, int] = field(default_factory=dict)  # a call's index in the reply -> its item's

    def push(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        started = next((k for k, c in enumerate(delta.calls) if c.name is not None), len(delta.calls))
        for c in delta.calls[:started]:
            events += self._arguments(c)
        if delta.content:
            events += self._text("message", delta.content)
        for c in delta.calls[started:]:
            if c.name is not None:
                events += self._close("completed")
                events += self._add({"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                                     "call_id": call_id(), "name": c.name, "arguments": ""})
                self.calls[c.index] = len(self.items) - 1
            events += self._arguments(c)
        return events

    def _arguments(self, c: ToolCallDelta) -> list[dict[str, Any]]:
        if not c.arguments:
            return []
        index = self.calls[c.index]
        item = self.items[index]
        item["arguments"] += c.arguments
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": c.arguments}]

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if complete and not any(item["type"] != "reasoning" for item in self.items):
            events += self._text("message", "")
        return events + self._close("completed" if complete else "incomplete")

    def text(self, kind: str) -> str:
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == kind)

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = True
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not (self.open and self.items[-1]["type"] == kind):
            events += self._close("completed")
            if kind == "reasoning":
                item: dict[str, Any] = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                        "status": "in_progress"}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._add(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(), "part": copy.deepcopy(part)})
        if text:
            self.items[-1]["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
            events.append({"type": name, **self._where(), "delta": text, **extra})
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self, status: str) -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            if item["type"] == "reasoning" and self.encrypted_reasoning:
                item["encrypted_content"] = part["text"]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            done: dict[str, Any] = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
            if item["type"] == "message":
                done = {**done, "type": "response.output_text.done", "logprobs": []}
            events = [done, {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)}]
        return [*events, {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


@dataclass(slots=True)
class _Reply:
    """One running response: its request, chat run, output, and what is needed to answer it."""

    body: ResponsesRequest
    run: ChatRun
    history: list[dict[str, Any]]
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: OutputItems = field(default_factory=OutputItems)
    usage: UsageTally = field(default_factory=UsageTally)
    finish_reason: str | None = None
    _parser: ChoiceParser = field(init=False)

    def __post_init__(self) -> None:
        self._parser = self.run.output.parser()
        self.output.encrypted_reasoning = ENCRYPTED_REASONING in (self.body.include or [])

    def add(self, d: SequenceDelta) -> list[dict[str, Any]]:
        self.usage.add(d)
        events = self.output.push(self._parser.push(d.text))
        if d.finished:
            self.finish_reason = d.finish_reason
            events += self.output.push(self._parser.finish())
            events += self.output.finish(d.finish_reason != "length")
        return events

    def response(self, status: str, model: str) -> dict[str, Any]:
        """The `response` object in `status`; output and usage only once it is done (completed or
        incomplete). `reasoning_tokens` counts the tokens of the reasoning text, re-encoded (the
        think tags are not in it); `cache_write_tokens`, a billing notion, is 0."""
        body = self.body
        usage = self.usage.body()
        done = status in ("completed", "incomplete")
        reasoning = self.output.text("reasoning") if done else ""
        reasoning_tokens = len(self.run.tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if done else None, "model": model, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "output": copy.deepcopy(self.output.items) if done else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": self.run.params.temperature, "top_p": self.run.params.top_p,
            "max_output_tokens": body.max_output_tokens,
            "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunctionChoice)
                            else body.tool_choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "reasoning": {"effort": body.reasoning.effort, "summary": None} if body.reasoning else None,
            "previous_response_id": body.previous_response_id, "store": bool(body.store),
            "truncation": "disabled", "background": False, "user": body.user,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                               "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": usage["total_tokens"]} if done else None,
        }

    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation so far in chat form: the history it continued, its input (without
        instructions) and its output, read back as input items as a client would send them."""
        output = _ITEMS.validate_python(self.output.items)
        return [*self.history, *chat_messages([*_input_items(self.body), *output])]


async def create_response(serving: Serving, store: ResponseStore, body: ResponsesRequest, request: Request) -> Response:
    """Checks the request (every 4xx before anything runs), runs it through `start_chat` and
    answers with the response object or its event stream; stores it if asked."""
    serving.check_request(body, body.model)
    if (unsupported := body.unsupported()) is not None:
        raise APIError(400, unsupported[1], param=unsupported[0], code=UNSUPPORTED_FIELD)
    if body.store and store.capacity == 0:
        raise APIError(400, "store is disabled on this server (--responses-store-size 0)", param="store")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous response with id '{body.previous_response_id}' not found",
                           param="previous_response_id", code="previous_response_not_found")
        history = previous.history
    tok = serving.tokenizer()
    thinking = _thinking(body, serving.reasoning_format(tok), tok.chat_template)
    try:
        run = await start_chat(serving, chat_request(body, history, thinking), "resp")
    except APIError as e:
        e.param = _PARAMS.get(e.param or "", e.param)
        raise
    reply = _Reply(body, run, history)
    if body.stream:
        return sse.SSEResponse(_events(serving, store, reply), on_close=run.stream.close,
                               keep_alive_s=serving.keep_alive_s)

    def on_delta(d: SequenceDelta) -> None:
        reply.add(d)

    try:
        if not await collect(request, run.stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    response = reply.response(reply.status(), serving.model_name)
    _keep(store, reply, response)
    return JSONResponse(response)


def _keep(store: ResponseStore, reply: _Reply, response: dict[str, Any]) -> None:
    if reply.body.store:
        store.put(reply.id, StoredResponse(response, reply.conversation(), listed_items(reply.body)))


async def _events(serving: Serving, store: ResponseStore, reply: _Reply) -> AsyncGenerator[bytes, None]:
    numbers = itertools.count()

    def event(payload: dict[str, Any]) -> bytes:
        return sse.named_event(payload["type"], {**payload, "sequence_number": next(numbers)})

    model = serving.model_name
    try:
        yield event({"type": "response.created", "response": reply.response("in_progress", model)})
        yield event({"type": "response.in_progress", "response": reply.response("in_progress", model)})
        async for deltas in reply.run.stream:
            for d in deltas:
                for e in reply.add(d):
                    yield event(e)
        status = reply.status()
        response = reply.response(status, model)
        _keep(store, reply, response)
        yield event({"type": f"response.{status}", "response": response})
    except Exception as e:
        error = stream_error(e)["error"]
        yield event({"type": "error", "message": error["message"], "code": error["code"], "param": error["param"]})


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as OpenAI lists them: typed, text content as parts, and each
    with an id (one made up where the client sent none)."""
    listed = []
    for item in _input_items(body):
        d = item.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem):
            part = "output_text" if item.role == "assistant" else "input_text"
            extra: dict[str, Any] = {"annotations": []} if item.role == "assistant" else {}
            content = [{"type": part, "text": item.content, **extra}] if isinstance(item.content, str) else d["content"]
            d = {**d, "type": "message", "content": content, "status": item.status or "completed"}
        d.setdefault("id", _new_id(_ITEM_ID_PREFIXES[d["type"]]))
        listed.append(d)
    return listed


def list_input_items(store: ResponseStore, response_id: str, query: dict[str, str]) -> JSONResponse:
    """`GET /v1/responses/{id}/input_items`: a page of `limit` items (1-100, default 20) in `order`
    ("desc", the default, or "asc"), after the item `after`."""
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response with id '{response_id}'", param="response_id", code="not_found")
    if unknown := sorted(set(query) - {"limit", "order", "after"}):
        raise APIError(400, f"unsupported query parameter: {unknown[0]}", param=unknown[0], code=UNSUPPORTED_FIELD)
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    items = entry.input_items if order == "asc" else entry.input_items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item '{after}' in this response", param="after")
        start = ids.index(after) + 1
    page = items[start:start + int(limit)]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < len(items)})


def get_response(store: ResponseStore, response_id: str) -> JSONResponse:
    entry = store.get(response_id)
    if entry is None:
        raise APIError(404, f"no stored response with id '{response_id}'", param="response_id", code="not_found")
    return JSONResponse(entry.body)


def delete_response(store: ResponseStore, response_id: str) -> JSONResponse:
    if not store.delete(response_id):
        raise APIError(404, f"no stored response with id '{response_id}'", param="response_id", code="not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
