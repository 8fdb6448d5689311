"""A chat choice's text split the way the API returns it: reasoning, content and tool calls.

The reasoning parser (if the model has one) sees the text first; the tool-call parser (if the
request has tools) sees only the content after the reasoning. A non-streamed message is built by
the same parsers fed the whole text, so it equals what the stream's deltas join to. With
`parallel_tool_calls` false a choice keeps only its first call: the text of any later call is
dropped, from the calls and from the content alike.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from nanoserve.server.chat.reasoning_parsers import ThinkParser
from nanoserve.server.chat.tool_parsers.calls import ToolCallDelta, ToolCallParser, join_calls


class ChoiceDelta(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCallDelta]


@dataclass(frozen=True, slots=True)
class ChatOutputFormat:
    """How one request's choices are parsed: `tools` makes a tool-call parser (None without
    tools), `reasoning` says whether a reasoning parser applies and `in_reasoning` whether the
    reply starts inside its think block; `parallel_tool_calls` false keeps one call a choice."""

    tools: type[ToolCallParser] | None = None
    reasoning: bool = False
    in_reasoning: bool = False
    parallel_tool_calls: bool = True

    def parser(self) -> ChoiceParser:
        return ChoiceParser(ThinkParser(self.in_reasoning) if self.reasoning else None,
                            self.tools() if self.tools is not None else None,
                            None if self.parallel_tool_calls else 1)

    def message(self, text: str) -> dict[str, Any]:
        """The `message` of a non-streamed choice with this text. Content is null when empty
        beside reasoning or calls; `reasoning_content` is present (maybe null) with a reasoning
        parser."""
        p = self.parser()
        first, last = p.push(text), p.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        calls = join_calls(first.calls + last.calls)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content if content or not (calls or reasoning) else None}
        if self.reasoning:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [{"id": call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message


@dataclass(slots=True)
class ChoiceParser:
    """One choice's parsers. Invariant: every call delta it returns has index < `max_calls`
    (None: no bound), and `num_calls` counts the calls it has returned."""

    think: ThinkParser | None
    tools: ToolCallParser | None
    max_calls: int | None = None
    num_calls: int = 0

    def push(self, text: str) -> ChoiceDelta:
        reasoning, content = self.think.push(text) if self.think is not None else ("", text)
        return self._tools(reasoning, content, final=False)

    def finish(self) -> ChoiceDelta:
        reasoning, content = self.think.finish() if self.think is not None else ("", "")
        return self._tools(reasoning, content, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> ChoiceDelta:
        if self.tools is None:
            return ChoiceDelta(reasoning, content, [])
        content, calls = self.tools.push(content)
        if final:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        if self.max_calls is not None:
            calls = [c for c in calls if c.index < self.max_calls]
        self.num_calls += sum(c.name is not None for c in calls)
        return ChoiceDelta(reasoning, content, calls)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_chunks(calls: list[ToolCallDelta]) -> list[list[dict[str, Any]]]:
    """The `delta.tool_calls` lists of the chunks that stream `calls`, as OpenAI sends them: a
    call's first chunk has its id, type, name and empty arguments; the argument deltas that follow
    it in `calls` are joined into one chunk per call."""
    chunks: list[list[dict[str, Any]]] = []
    for c in calls:
        if c.name is not None:
            chunks.append([{"index": c.index, "id": call_id(), "type": "function",
                            "function": {"name": c.name, "arguments": ""}}])
        elif chunks and "id" not in chunks[-1][0] and chunks[-1][0]["index"] == c.index:
            chunks[-1][0]["function"]["arguments"] += c.arguments
        else:
            chunks.append([{"index": c.index, "function": {"arguments": c.arguments}}])
    return chunks
