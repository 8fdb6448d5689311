"""What a tool-call parser returns and the interface every format's parser implements.

`ToolCallParser` is the protocol a format's parser class satisfies: pushed one sequence's text
deltas, it returns content and `ToolCallDelta`s (see the package docstring for their contract);
its class says whether the format's markers are special tokens (`needs_special_tokens`) and how a
forced call is written in it (`forced_format`, used by `forced_tools`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol


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


@dataclass(frozen=True, slots=True)
class ForcedCallFormat:
    """How a format writes calls, for a grammar that forces them: a call's `pieces` (marker or
    plain text, None for the JSON object `{"name": ..., <arguments_key>: {...}}`) and the text
    `between` two calls."""

    pieces: tuple[str | None, ...]
    arguments_key: str
    between: str


class ToolCallParser(Protocol):
    needs_special_tokens: ClassVar[bool]  # the format uses special tokens: decode them into the text
    forced_format: ClassVar[ForcedCallFormat | None]  # None: a call cannot be forced in this format

    def push(self, text: str) -> Parsed:
        """Content to send now and the call deltas `text` made final."""
        ...

    def finish(self) -> Parsed:
        """At the end of the sequence: the held-back content and the last call deltas."""
        ...


def join_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """The complete calls of a sequence's deltas, in order."""
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.name is not None:
            names[d.index] = d.name
        arguments.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]
