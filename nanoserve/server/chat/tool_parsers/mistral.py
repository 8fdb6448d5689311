"""The `mistral` tool-call format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older
templates) or one `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later; an optional
`[CALL_ID]id` before `[ARGS]` is skipped). `[TOOL_CALLS]` is a special token, so this format needs
the special tokens kept in the text (`needs_special_tokens`). A call cannot be forced in it.

Invariant: text that cannot become a call after `[TOOL_CALLS]` is content, the tag included,
exactly as generated.
"""

from __future__ import annotations

import re
from typing import ClassVar

from nanoserve.server.chat.tool_parsers.calls import ForcedCallFormat, Parsed
from nanoserve.server.chat.tool_parsers.json_scanner import CallObject, Fed, Output, held_back, parse_calls

_NAME = re.compile(r"[A-Za-z0-9_.-]*")
_CALL_ID_TEXT = re.compile(r"[A-Za-z0-9]*")


class MistralParser:
    """Content until `[TOOL_CALLS]`; then either a JSON list of call objects (each streamed as it
    arrives; an object that is not a call header holds the rest of the list to the end of the
    message, where it is decoded whole or, failing that, is content as generated) or the v11 form
    `name[ARGS]{...}`, the name held until `[ARGS]` and the arguments object streamed. After a
    call (or the list's `]`), text is content again, and another `[TOOL_CALLS]` starts more calls."""

    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    needs_special_tokens: ClassVar[bool] = True
    forced_format: ClassVar[ForcedCallFormat | None] = None

    def __init__(self) -> None:
        self._buf = ""
        self._raw = ""  # the text since the last [TOOL_CALLS] (content, should it not be calls)
        self._mode = "content"  # content, tag (just after it), name, args, list or whole
        self._call: CallObject | None = None
        self._out = Output()
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
            calls = parse_calls(self._call.text, ",]")
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
                self._call = CallObject()
                self._call.commit(name)
                self._out.fed(Fed(name, "", ""))
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
            self._call = CallObject()
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
