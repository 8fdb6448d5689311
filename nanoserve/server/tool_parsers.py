"""Tool calls in generated text (the OpenAI `tools` API), in the formats of the families we serve.

- `hermes` (Qwen2.5, Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, possibly several, possibly after some content text.
- `llama3_json` (Llama 3.1 to 3.3): the whole message is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`.

A parser is fed one sequence's text deltas and returns what to send: content text, which never
holds any part of a call (a suffix that may still begin one is held back, as a stop string is),
and each call once it is complete. Text that looks like a call but does not parse as one is
content, exactly as generated. Once a call has been seen, whitespace-only content (the newlines
between calls) is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

PARSER_NAMES = ("auto", "hermes", "llama3_json", "none")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text, as the OpenAI API carries it


class ToolCallParser(Protocol):
    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content to send now and the calls completed by `text`."""
        ...

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the sequence: the held-back content and any last call."""
        ...


def parser_factory(name: str, chat_template: str | None) -> Callable[[], ToolCallParser] | None:
    """The parser class for `--tool-call-parser`; "auto" reads the chat template: `<tool_call>` is
    hermes, `<|python_tag|>` llama3_json, anything else (or "none") no parser."""
    if name not in PARSER_NAMES:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}")
    if name == "auto":
        template = chat_template or ""
        name = "hermes" if "<tool_call>" in template else "llama3_json" if "<|python_tag|>" in template else "none"
    parsers: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
    return parsers.get(name)


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


def _held_back(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._seen_call = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                i = self._buf.find(self.START)
                if i < 0:
                    cut = len(self._buf) - _held_back(self._buf, self.START)
                    content.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(self.START):]
                self._in_call = True
            else:
                j = self._buf.find(self.END)
                if j < 0:
                    break
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(self.END):], False
                self._close(body, content, calls)
        return self._content(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, calls = self.push("")
        content = [text]
        if self._in_call:  # cut short before its closing tag (EOS or a stop string came first)
            self._close(self._buf, content, calls, closed=False)
        else:
            content.append(self._buf)
        self._buf, self._in_call = "", False
        return self._content(content), calls

    def _close(self, body: str, content: list[str], calls: list[ToolCall], closed: bool = True) -> None:
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            content.append(self.START + body + (self.END if closed else ""))
        else:
            calls.append(call)
            self._seen_call = True

    def _content(self, parts: list[str]) -> str:
        text = "".join(parts)
        return "" if self._seen_call and not text.strip() else text


class Llama3JsonParser:
    """Decides on the first text that is not whitespace: a message that starts with `{` or
    `<|python_tag|>` is buffered to its end and parsed as calls; any other is content, sent as it
    comes."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None (undecided), "content" or "calls"

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "content":
            return text, []
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode = "calls"
            elif head and not self.TAG.startswith(head):
                self._mode, out, self._buf = "content", self._buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if self._mode != "calls":
            return text, []
        calls = self._parse(text.strip().removeprefix(self.TAG))
        return ("", calls) if calls else (text, [])

    @staticmethod
    def _parse(text: str) -> list[ToolCall]:
        """Every `;`-separated JSON object as a call, or [] if any part is not one."""
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                return calls
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError:
                return []
            call = _call(obj)
            if call is None:
                return []
            calls.append(call)
