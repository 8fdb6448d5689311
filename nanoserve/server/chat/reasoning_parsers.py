"""Reasoning in generated text: a `<think>...</think>` block (DeepSeek-R1, Qwen3, QwQ) before the
answer, returned apart as `reasoning_content`. The formats, by name (`REASONING_PARSERS`):

- `deepseek_r1`: the reply is reasoning from its start (the template opens the block, or the model
  does) until `</think>`; a reply with no `</think>` is all reasoning.
- `qwen3`: the reply is reasoning only if it opens with `<think>` (after any whitespace) or the
  prompt left a block open; otherwise it is all content (e.g. with `enable_thinking: false`, whose
  prompt already holds an empty block).

Either way the rendered prompt decides first: a prompt that ends inside an open `<think>` starts
the reply in reasoning, and one that ends just after a closed block (thinking switched off)
starts it in content. A reply cut inside the block is all reasoning. The tags are never sent, nor
any part of one (a suffix that may still begin a tag is held back); the whitespace between the
block and the answer is dropped from the content.

A format differs from another only in its entry (`ReasoningFormat`): adding one is one entry in
`REASONING_PARSERS`, from which the names the server and the CLI accept, "auto" detection and the
errors follow (see `parser_registry`).

Invariant: the split does not depend on how the text is divided into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from nanoserve.server.chat.parser_registry import ParserRegistry
from nanoserve.server.chat.tool_parsers.json_scanner import held_back

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A registered reasoning format: whether a reply starts inside the think block when the
    prompt leaves it to the format (neither opens nor just closed one), the markers a chat
    template of it contains (all of them) and a few words for the CLI help."""

    reply_starts_inside: bool
    markers: tuple[str, ...]
    summary: str


REASONING_PARSERS = ParserRegistry("reasoning parser", {
    "deepseek_r1": ReasoningFormat(reply_starts_inside=True, markers=(END,), summary="replies start in it"),
    "qwen3": ReasoningFormat(reply_starts_inside=False, markers=(END, "enable_thinking"),
                             summary="only when they open it"),
})
REASONING_PARSER_NAMES = REASONING_PARSERS.names


class Split(NamedTuple):
    reasoning: str
    content: str


def reasoning_parser_name(name: str, chat_template: str | None) -> str | None:
    """The format `--reasoning-parser` names: "auto" reads the chat template, and a template that
    shows no registered format (or "none") has no parser (None)."""
    return REASONING_PARSERS.choose(name, chat_template)


def starts_in_reasoning(name: str, prompt_tail: str) -> bool:
    """Whether the reply to a prompt ending in `prompt_tail` begins inside the think block."""
    opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
    if opened > closed:
        return True
    if closed >= 0 and not prompt_tail[closed + len(END):].strip():
        return False
    return REASONING_PARSERS[name].reply_starts_inside


def closed_before_reply(prompt_tail: str) -> bool:
    """Whether the prompt ends just after a closed think block (thinking switched off): the
    reply is all content and opens no block."""
    opened, closed = prompt_tail.rfind(START), prompt_tail.rfind(END)
    return closed > opened and not prompt_tail[closed + len(END):].strip()


class ThinkParser:
    """Splits one sequence's text deltas into reasoning and content."""

    def __init__(self, in_reasoning: bool) -> None:
        self._in_reasoning = in_reasoning  # where text goes unless the reply opens a block itself
        self._state = "start"  # start (undecided), reasoning, gap (whitespace after the block) or content
        self._buf = ""

    def push(self, text: str) -> Split:
        if self._state == "content":
            return Split("", text)
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(START):
                self._state, self._buf = "reasoning", head[len(START):]
            elif not head or START.startswith(head):
                return Split("", "")
            else:
                self._state = "reasoning" if self._in_reasoning else "content"
                if self._state == "content":
                    content, self._buf = self._buf, ""
        if self._state == "reasoning":
            i = self._buf.find(END)
            if i < 0:
                cut = len(self._buf) - held_back(self._buf, END)
                reasoning, self._buf = self._buf[:cut], self._buf[cut:]
                return Split(reasoning, "")
            reasoning, self._buf, self._state = self._buf[:i], self._buf[i + len(END):], "gap"
        if self._state == "gap":
            content, self._buf = self._buf.lstrip(), ""
            if content:
                self._state = "content"
        return Split(reasoning, content)

    def finish(self) -> Split:
        """The held-back text: a reply still undecided (blank, or a partial `<think>`) goes where
        its start would, and a partial `</think>` is reasoning."""
        text, self._buf = self._buf, ""
        if self._state == "reasoning" or (self._state == "start" and self._in_reasoning):
            return Split(text, "")
        return Split("", text if self._state == "start" else "")
