"""Forced tool calls on a model whose chat template shows no tool-call format: the message is a
JSON array of `{"name": ..., "arguments": {...}}` objects, which the grammar of
`forced_tools.forced_json_calls` makes it (vLLM's way of forcing calls without a parser). The
format is never detected from a template, so it is not in the registry: the server picks it only
for `tool_choice` "required" or a named function when no registered parser applies.

Invariant: calls stream as their objects arrive (name first, then each character of the
arguments exactly once); the array's brackets and the separators between calls are never content.
"""

from __future__ import annotations

from typing import ClassVar

from nanoserve.server.chat.tool_parsers.calls import ForcedCallFormat, Parsed
from nanoserve.server.chat.tool_parsers.json_scanner import CallObject, Output

_BETWEEN = " \t\r\n[,]"  # what may stand outside the call objects of the array


class JsonListParser:
    """Streams the call objects of a JSON array. An object that is not a call header (possible
    only when the grammar did not apply) turns the rest of the message into content."""

    needs_special_tokens: ClassVar[bool] = False
    forced_format: ClassVar[ForcedCallFormat | None] = None  # forced by a JSON schema, not by markers

    def __init__(self) -> None:
        self._buf = ""  # text not yet passed to a call object
        self._call: CallObject | None = None
        self._out = Output()

    def push(self, text: str) -> Parsed:
        if self._call is not None and self._call.rejected:
            self._call.feed(text)
            return Parsed("", [])
        self._buf += text
        while self._buf:
            if self._call is None:
                self._buf = self._buf.lstrip(_BETWEEN)
                if not self._buf:
                    break
                self._call = CallObject()
            fed = self._call.feed(self._buf)
            self._out.fed(fed)
            self._buf = fed.rest
            if self._call.rejected:
                break
            if self._call.done:
                self._call = None
        return self._out.take()

    def finish(self) -> Parsed:
        if self._call is not None and self._call.name is None:
            self._out.text(self._call.text)  # not a call: content as generated
        return self._out.take()
