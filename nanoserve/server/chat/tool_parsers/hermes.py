"""The `hermes` tool-call format (Qwen2.5, Qwen3, Hermes): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several, possibly after some
content text. A forced call is written `<tool_call>\\n{...}\\n</tool_call>`, calls separated by a
newline.

Invariant: text outside the tags is content; a call between them streams once its header is read,
and one that is not a call is content again, tags and all, exactly as generated.
"""

from __future__ import annotations

import json
from typing import ClassVar

from nanoserve.server.chat.tool_parsers.calls import ForcedCallFormat, Parsed
from nanoserve.server.chat.tool_parsers.json_scanner import CallObject, Output, decode_call, held_back


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    needs_special_tokens: ClassVar[bool] = False
    forced_format: ClassVar[ForcedCallFormat | None] = ForcedCallFormat(
        pieces=(START, "\n", None, "\n", END), arguments_key="arguments", between="\n")

    def __init__(self) -> None:
        self._buf = ""
        self._call: CallObject | None = None  # the call between the tags, while inside them
        self._out = Output()

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
                self._call = CallObject()
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
            whole = decode_call(json.loads(call.text))
        except json.JSONDecodeError:
            whole = None
        if whole is None:
            self._out.text(self.START + call.text + (self.END if closed else ""))
        else:
            self._out.whole(whole)
