"""The pieces every tool-call parser is built from: a call object scanned as it arrives
(`CallObject`), whole texts decoded as calls (`decode_call`, `parse_calls`), the content and call
deltas a parser sends (`Output`), and the suffix of a text held back because it may begin a
marker (`held_back`).

Invariants: `CallObject` passes on nothing until its text is known to be a call (until then the
caller may still decode that text whole or send it as content), then each character of the
arguments object exactly once; `Output` numbers a sequence's calls from 0 in order and drops the
whitespace-only content between calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nanoserve.server.chat.tool_parsers.calls import Parsed, ToolCall, ToolCallDelta


def held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def decode_call(obj: Any) -> ToolCall | None:
    """A call from a decoded JSON object with a string `name` and an `arguments` (or
    `parameters`) object; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_calls(text: str, separators: str) -> list[ToolCall] | None:
    """Every JSON object of `text` (separated by whitespace and `separators`) as a call, or None if
    any part is not one."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return calls
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = decode_call(obj)
        if call is None:
            return None
        calls.append(call)


def _string_end(text: str, pos: int) -> int | None:
    """The index after the JSON string starting at `text[pos] == '"'`, or None if it is unfinished."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


_MORE, _NOT = True, False  # what `_header` says of a text that is not a header yet / cannot become one


def _header(text: str) -> tuple[str, int] | bool:
    """Matches `{"name": <string>, "arguments" | "parameters": {` at the start of `text` (JSON
    whitespace anywhere between): (name, index of the arguments' `{`), or _MORE, or _NOT. Monotone:
    a longer text with the same start gives the same answer unless the answer was _MORE."""
    pos, name = 0, ""
    for step in ("{", "key:name", ":", "name", ",", "key:args", ":", "{args"):
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if pos == len(text):
            return _MORE
        if step in ("{", ":", ",", "{args"):
            if text[pos] != step[0]:
                return _NOT
            if step == "{args":
                return name, pos
            pos += 1
            continue
        if text[pos] != '"':
            return _NOT
        end = _string_end(text, pos)
        if end is None:
            return _MORE
        try:
            value = json.loads(text[pos:end])
        except json.JSONDecodeError:
            return _NOT
        if step == "key:name" and value != "name":
            return _NOT
        if step == "key:args" and value not in ("arguments", "parameters"):
            return _NOT
        if step == "name":
            name = value
        pos = end
    raise AssertionError("unreachable")


@dataclass(slots=True)
class _JsonDepth:
    """Tracks JSON nesting over text fed in pieces (strings and escapes included)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """The index after the character of `text` that brings the depth back to 0, else None."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class Fed(NamedTuple):
    name: str | None  # the call's name, on the feed that committed the call
    arguments: str  # arguments text this feed added
    rest: str  # text after the call object's closing brace


@dataclass(slots=True)
class CallObject:
    """One `{"name": ..., "arguments": {...}}` object, scanned as it arrives.

    Invariant: until `name` is set, nothing has been passed on and `text` holds all that was fed,
    so the caller may still decode it whole or treat it as content; `rejected` means it does not
    start with a call header. Once `name` is set (committed), each character of the arguments
    object is passed on exactly once; after the object's closing brace, `done` is set and any
    further text is handed back as `rest`.
    """

    text: str = ""
    name: str | None = None
    rejected: bool = False
    done: bool = False
    args_only: bool = False  # the text is the arguments object alone (the Mistral v11 form)
    _args: _JsonDepth = field(default_factory=_JsonDepth)
    _tail: _JsonDepth = field(default_factory=lambda: _JsonDepth(depth=1))
    _args_done: bool = False

    def feed(self, text: str) -> Fed:
        if self.done:
            return Fed(None, "", text)
        if self.rejected:
            self.text += text
            return Fed(None, "", "")
        committed = None
        if self.name is None:
            self.text += text
            header = _header(self.text)
            if not isinstance(header, tuple):
                self.rejected = header is _NOT
                return Fed(None, "", "")
            committed, start = header
            self.name, text = committed, self.text[start:]
        args = ""
        if not self._args_done:
            end = self._args.scan(text)
            if end is None:
                return Fed(committed, text, "")
            self._args_done = True
            args, text = text[:end], text[end:]
            if self.args_only:
                self.done = True
                return Fed(committed, args, text)
        end = self._tail.scan(text)
        if end is None:
            return Fed(committed, args, "")
        self.done = True
        return Fed(committed, args, text[end:])

    def commit(self, name: str) -> None:
        """Starts an arguments-only object (`args_only`) of a call whose name came before it."""
        self.name, self.args_only = name, True


@dataclass(slots=True)
class Output:
    """What one sequence's parser sends, in order: content and call deltas. Whitespace-only content
    after a call (the newlines between calls) is held until other text follows it, and dropped if
    a call or the end comes first."""

    count: int = 0  # calls so far
    content: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)
    _space: str | None = None  # whitespace held since the last call; None once text followed it

    def text(self, text: str) -> None:
        if self._space is None:
            self.content.append(text)
            return
        self._space += text
        if self._space.strip():
            self.content.append(self._space)
            self._space = None

    def fed(self, fed: Fed) -> None:
        if fed.name is not None:
            self.calls.append(ToolCallDelta(self.count, fed.name))
            self.count += 1
            self._space = ""
        if fed.arguments:
            self.calls.append(ToolCallDelta(self.count - 1, None, fed.arguments))

    def whole(self, call: ToolCall) -> None:
        self.calls += [ToolCallDelta(self.count, call.name), ToolCallDelta(self.count, None, call.arguments)]
        self.count += 1
        self._space = ""

    def take(self) -> Parsed:
        out = Parsed("".join(self.content), self.calls)
        self.content, self.calls = [], []
        return out
