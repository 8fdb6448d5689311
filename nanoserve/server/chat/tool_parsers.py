"""Tool calls in generated text (the OpenAI `tools` API), in the formats of the families we serve.

- `hermes` (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, possibly several, possibly after some content text.
- `llama3_json` (Llama 3.1 to 3.3): the whole message is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older templates) or one
  `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later; an optional `[CALL_ID]id` before `[ARGS]`
  is skipped). `[TOOL_CALLS]` is a special token, so this format needs the special tokens kept in
  the text (`needs_special_tokens`).

A parser is fed one sequence's text deltas and returns what to send: content text, which never
holds any part of a call (a suffix that may still begin one is held back, as a stop string is),
and `ToolCallDelta`s as OpenAI streams them: a call's first delta carries its name (and empty
arguments), the next ones carry its arguments text as it arrives. A call is committed once its
text reads `{"name": "<name>", "arguments": {` (or `"parameters"`; in the Mistral v11 form
`name[ARGS]{`); from then on its arguments are the arguments object exactly as generated (cut
short if generation was), and joining the deltas of a call gives them. Text that looks like a call
but is not of that shape is held to the end of the call and decoded whole; if it is not a call
either, it is content, exactly as generated. Once a call has been seen, whitespace-only content
(the newlines between calls) is dropped.

Invariant: the result does not depend on how the text is split into deltas, so a non-streamed
response (the whole text pushed at once) carries the same calls as the joined deltas of a stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol

PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as the OpenAI API carries it


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the `index`-th call of a sequence: its first delta has the `name`, later ones
    (name None) extend its `arguments` text."""

    index: int
    name: str | None
    arguments: str = ""


class Parsed(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


class ToolCallParser(Protocol):
    needs_special_tokens: ClassVar[bool]  # the format uses special tokens: decode them into the text

    def push(self, text: str) -> Parsed:
        """Content to send now and the call deltas `text` made final."""
        ...

    def finish(self) -> Parsed:
        """At the end of the sequence: the held-back content and the last call deltas."""
        ...


def parser_factory(name: str, chat_template: str | None) -> type[ToolCallParser] | None:
    """The parser class for `--tool-call-parser`; "auto" reads the chat template: `<tool_call>` is
    hermes, `<|python_tag|>` llama3_json, `[TOOL_CALLS]` mistral, anything else (or "none") no
    parser."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")
    if name == "auto":
        template = chat_template or ""
        markers = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))
        name = next((parser for marker, parser in markers if marker in template), "none")
    parsers: dict[str, type[ToolCallParser]] = {
        "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}
    return parsers.get(name)


def join_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The complete calls of a sequence's deltas, in order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]


def _call(obj: Any) -> ToolCall | None:
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


def _parse_calls(text: str, separators: str) -> list[ToolCall] | None:
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
        call = _call(obj)
        if call is None:
            return None
        calls.append(call)


def held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


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


class _Fed(NamedTuple):
    name: str | None  # the call's name, on the feed that committed the call
    arguments: str  # arguments text this feed added
    rest: str  # text after the call object's closing brace


@dataclass(slots=True)
class _CallObject:
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

    def feed(self, text: str) -> _Fed:
        if self.done:
            return _Fed(None, "", text)
        if self.rejected:
            self.text += text
            return _Fed(None, "", "")
        committed = None
        if self.name is None:
            self.text += text
            header = _header(self.text)
            if not isinstance(header, tuple):
                self.rejected = header is _NOT
                return _Fed(None, "", "")
            committed, start = header
            self.name, text = committed, self.text[start:]
        args = ""
        if not self._args_done:
            end = self._args.scan(text)
            if end is None:
                return _Fed(committed, text, "")
            self._args_done = True
            args, text = text[:end], text[end:]
            if self.args_only:
                self.done = True
                return _Fed(committed, args, text)
        end = self._tail.scan(text)
        if end is None:
            return _Fed(committed, args, "")
        self.done = True
        return _Fed(committed, args, text[end:])

    def commit(self, name: str) -> None:
        """Starts an arguments-only object (`args_only`) of a call whose name came before it."""
        self.name, self.args_only = name, True


@dataclass(slots=True)
class _Output:
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

    def fed(self, fed: _Fed) -> None:
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


class HermesParser:
    needs_special_tokens: ClassVar[bool] = False
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._call: _CallObject | None = None  # the call between the tags, while inside them
        self._out = _Output()

    def push(self, text: str) -> Parsed:
        self._buf += text
        while True:
            if self._call is None:
                i = self._buf.find(self.START)
                if i < 0:
                    cut = len(self._buf) - held_back(self._buf, self.START)
                    self._out.text(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                self._out.text(self._buf[:i])
                self._buf = self._buf[i + len(self.START):]
                self._call = _CallObject()
            else:
                j = self._buf.find(self.END)
                if j < 0:
                    cut = len(self._buf) - held_back(self._buf, self.END)
                    self._out.fed(self._call.feed(self._buf[:cut]))
                    self._buf = self._buf[cut:]
                    break
                self._out.fed(self._call.feed(self._buf[:j]))
                self._buf = self._buf[j + len(self.END):]
                self._close(closed=True)
        return self._out.take()

    def finish(self) -> Parsed:
        self.push("")
        if self._call is not None:  # cut short before its closing tag (EOS or a stop string came first)
            self._out.fed(self._call.feed(self._buf))
            self._close(closed=False)
        else:
            self._out.text(self._buf)
        self._buf = ""
        return self._out.take()

    def _close(self, closed: bool) -> None:
        call, self._call = self._call, None
        assert call is not None
        if call.name is not None:
            return
        try:
            whole = _call(json.loads(call.text))
        except json.JSONDecodeError:
            whole = None
        if whole is None:
            self._out.text(self.START + call.text + (self.END if closed else ""))
        else:
            self._out.whole(whole)


class Llama3JsonParser:
    """Decides on the first text that is not whitespace: a message that starts with `{` or
    `<|python_tag|>` is calls separated by `;`, any other is content, sent as it comes. Calls are
    streamed as they arrive; text after them that does not open another object is content (from
    its first character that is not whitespace). From an object that is not a call header on, the
    message is held to its end: calls if it all decodes as calls, else content as generated."""

    needs_special_tokens: ClassVar[bool] = False
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._text = ""  # the whole message so far (content, should its first object not be a call)
        self._buf = ""  # text not yet passed to a call object
        self._mode: str | None = None  # None (undecided), "content", "calls" or "whole" (held to the end)
        self._call: _CallObject | None = None
        self._out = _Output()

    def push(self, text: str) -> Parsed:
        self._text += text
        if self._mode == "content":
            return Parsed(text, [])
        if self._mode == "whole":
            assert self._call is not None
            self._call.feed(text)
            return Parsed("", [])
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode, self._buf = "calls", head.removeprefix(self.TAG)
            elif head and not self.TAG.startswith(head):
                self._mode, self._buf = "content", ""
                return Parsed(self._text, [])
            else:
                return Parsed("", [])
        while self._buf:
            if self._call is None:
                self._buf = self._buf.lstrip(" \t\r\n;")
                if self._buf and self._buf[0] != "{":
                    self._out.text(self._buf)
                    self._mode, self._buf = "content", ""
                    break
                if not self._buf:
                    break
                self._call = _CallObject()
            fed = self._call.feed(self._buf)
            self._out.fed(fed)
            self._buf = fed.rest
            if self._call.rejected:
                self._mode = "whole"
            elif self._call.done:
                self._call = None
        return self._out.take()

    def finish(self) -> Parsed:
        if self._mode is None:
            return Parsed(self._text, [])
        if self._mode == "content" or self._call is None or self._call.name is not None:
            return self._out.take()
        calls = _parse_calls(self._call.text, ";")
        if calls is None:  # content as generated: the whole message, or what follows its calls
            self._out.text(self._call.text if self._out.count else self._text)
            return self._out.take()
        for call in calls:
            self._out.whole(call)
        return self._out.take()


_NAME = re.compile(r"[A-Za-z0-9_.-]*")
_CALL_ID_TEXT = re.compile(r"[A-Za-z0-9]*")


class MistralParser:
    """Content until `[TOOL_CALLS]`; then either a JSON list of call objects (each streamed as it
    arrives; an object that is not a call header holds the rest of the list to the end of the
    message, where it is decoded whole or, failing that, is content as generated) or the v11 form
    `name[ARGS]{...}`, the name held until `[ARGS]` and the arguments object streamed. After a
    call (or the list's `]`), text is content again, and another `[TOOL_CALLS]` starts more calls."""

    needs_special_tokens: ClassVar[bool] = True
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

    def __init__(self) -> None:
        self._buf = ""
        self._raw = ""  # the text since the last [TOOL_CALLS] (content, should it not be calls)
        self._mode = "content"  # content, tag (just after it), name, args, list or whole
        self._call: _CallObject | None = None
        self._out = _Output()
        self._listed = 0  # calls of the current list committed

    def push(self, text: str) -> Parsed:
        self._buf += text
        if self._mode != "content":
            self._raw += text
        while self._step():
            pass
        return self._out.take()

    def finish(self) -> Parsed:
        self.push("")
        if self._mode == "content":
            self._out.text(self._buf)
        elif self._mode in ("tag", "name") or (self._mode == "list" and self._call is None and not self._listed):
            self._out.text(self._raw)
        elif self._mode in ("list", "whole") and self._call is not None and self._call.name is None:
            calls = _parse_calls(self._call.text, ",]")
            if calls is None:
                self._out.text(self._call.text if self._listed else self._raw)
            for call in calls or []:
                self._out.whole(call)
        self._buf, self._mode = "", "content"
        return self._out.take()

    def _step(self) -> bool:
        """Consumes what it can of the buffer in the current mode; True if another step may."""
        buf = self._buf
        if self._mode == "content":
            i = buf.find(self.TAG)
            if i < 0:
                cut = len(buf) - held_back(buf, self.TAG)
                self._out.text(buf[:cut])
                self._buf = buf[cut:]
                return False
            self._out.text(buf[:i])
            self._buf, self._raw = buf[i + len(self.TAG):], buf[i:]
            self._mode = "tag"
            return True
        if self._mode == "tag":
            head = buf.lstrip()
            if not head:
                return False
            if head.startswith("["):
                self._mode, self._buf, self._call, self._listed = "list", head[1:], None, 0
            else:
                self._mode, self._buf = "name", head
            return True
        if self._mode == "name":
            return self._name()
        if self._mode == "whole":
            assert self._call is not None
            self._call.feed(buf)
            self._buf = ""
            return False
        if self._mode == "args":
            assert self._call is not None
            fed = self._call.feed(buf)
            self._out.fed(fed)
            self._buf = fed.rest
            if self._call.done:
                self._mode, self._call = "content", None
                return True
            return False
        return self._list()

    def _name(self) -> bool:
        """`name[ARGS]{`, with an optional `[CALL_ID]id` before `[ARGS]`: commits the call. Text
        that cannot become that is content, `[TOOL_CALLS]` included."""
        i = self._buf.find(self.ARGS)
        name, sep, call_id = (self._buf if i < 0 else self._buf[:i]).partition(self.CALL_ID)
        if i < 0:
            if self._may_become_header(name, sep, call_id):
                return False
        else:
            args = self._buf[i + len(self.ARGS):].lstrip()
            if name and _NAME.fullmatch(name) and _CALL_ID_TEXT.fullmatch(call_id) and args[:1] in ("", "{"):
                if not args:
                    return False
                self._call = _CallObject()
                self._call.commit(name)
                self._out.fed(_Fed(name, "", ""))
                self._mode, self._buf = "args", args
                return True
        self._out.text(self.TAG)
        self._mode, self._buf = "content", self._raw[len(self.TAG):]
        return True

    def _may_become_header(self, name: str, sep: str, call_id: str) -> bool:
        if sep and not (name and _NAME.fullmatch(name)):
            return False
        held = call_id if sep else name
        tail = held[(_CALL_ID_TEXT if sep else _NAME).match(held).end():]  # type: ignore[union-attr]
        return not tail or self.ARGS.startswith(tail) or (not sep and self.CALL_ID.startswith(tail))

    def _list(self) -> bool:
        """The JSON list form: objects separated by `,`, closed by `]`."""
        if self._call is None:
            head = self._buf.lstrip(" \t\r\n,")
            self._buf = head
            if not head:
                return False
            if head[0] == "]":
                self._mode, self._buf = "content", head[1:]
                return True
            self._call = _CallObject()
        fed = self._call.feed(self._buf)
        self._out.fed(fed)
        self._buf = fed.rest
        if fed.name is not None:
            self._listed += 1
        if self._call.rejected:
            self._mode, self._buf = "whole", ""
            return False
        if self._call.done:
            self._call = None
            return True
        return False
