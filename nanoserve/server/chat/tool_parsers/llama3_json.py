"""The `llama3_json` tool-call format (Llama 3.1 to 3.3): the whole message is one or more JSON
objects `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`.
A forced call is written as the JSON object alone, calls separated by `; `.

Invariant: the message is decided on its first text that is not whitespace; content is never
held back once that text shows the message is not calls.
"""

from __future__ import annotations

from typing import ClassVar

from nanoserve.server.chat.tool_parsers.calls import ForcedCallFormat, Parsed
from nanoserve.server.chat.tool_parsers.json_scanner import CallObject, Output, parse_calls


class Llama3JsonParser:
    """Decides on the first text that is not whitespace: a message that starts with `{` or
    `<|python_tag|>` is calls separated by `;`, any other is content, sent as it comes. Calls are
    streamed as they arrive; text after them that does not open another object is content (from
    its first character that is not whitespace). From an object that is not a call header on, the
    message is held to its end: calls if it all decodes as calls, else content as generated."""

    TAG = "<|python_tag|>"
    needs_special_tokens: ClassVar[bool] = False
    forced_format: ClassVar[ForcedCallFormat | None] = ForcedCallFormat(
        pieces=(None,), arguments_key="parameters", between="; ")

    def __init__(self) -> None:
        self._text = ""  # the whole message so far (content, should its first object not be a call)
        self._buf = ""  # text not yet passed to a call object
        self._mode: str | None = None  # None (undecided), "content", "calls" or "whole" (held to the end)
        self._call: CallObject | None = None
        self._out = Output()

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
                self._call = CallObject()
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
        calls = parse_calls(self._call.text, ";")
        if calls is None:  # content as generated: the whole message, or what follows its calls
            self._out.text(self._call.text if self._out.count else self._text)
            return self._out.take()
        for call in calls:
            self._out.whole(call)
        return self._out.take()
