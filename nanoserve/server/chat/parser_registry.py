"""The registry shape both chat output parsers share (tool calls, reasoning): an immutable mapping
of format name to entry, and everything the server and the CLI derive from it.

A registry's valid names are "auto", its formats in registration order, then "none"; the CLI
choices, the check of a configured name and its error message, and the help text all come from
it, so a format is added by one entry and nothing else. "auto" reads the chat template: each
entry names the markers whose presence in a template shows its format, and the template's format
is the most specific entry whose markers all appear (most markers; the first registered among
equals); none (no parser) when no entry's markers all appear.

Invariant: a registry never changes after it is built (its mapping is a read-only view of a copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeVar

AUTO, NONE = "auto", "none"


class Recognisable(Protocol):
    """What every registry entry says of its format."""

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts a chat template of this format contains, all of them."""
        ...

    @property
    def summary(self) -> str:
        """A few words for the CLI help, after the format's name."""
        ...


E = TypeVar("E", bound=Recognisable)


@dataclass(frozen=True, eq=False)
class ParserRegistry(Mapping[str, E]):
    """Format name -> entry, for the parsers of one `kind` (e.g. "tool-call parser")."""

    kind: str
    formats: Mapping[str, E]

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", MappingProxyType(dict(self.formats)))

    def __getitem__(self, name: str) -> E:
        return self.formats[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.formats)

    def __len__(self) -> int:
        return len(self.formats)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a server may be configured with."""
        return (AUTO, *self.formats, NONE)

    def check(self, name: str) -> None:
        """A ValueError, listing the valid names, unless `name` is one."""
        if name not in self.names:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names)}")

    def detect(self, chat_template: str | None) -> str | None:
        """The format a chat template shows (None: no registered one)."""
        template = chat_template or ""
        found = [name for name, entry in self.formats.items() if all(m in template for m in entry.markers)]
        return max(found, key=lambda name: len(self.formats[name].markers), default=None)

    def choose(self, name: str, chat_template: str | None) -> str | None:
        """The format a configured `name` selects for a model with this chat template: the
        template's with "auto", none (None) with "none"; a ValueError for an unknown name."""
        self.check(name)
        if name == AUTO:
            return self.detect(chat_template)
        return None if name == NONE else name

    def help(self) -> str:
        """The valid names with their summaries, as the CLI help lists them."""
        formats = "".join(f"{name} ({entry.summary}), " for name, entry in self.formats.items())
        return f"{formats}{NONE}, or {AUTO} (read from the chat template)"

    def alternatives(self) -> str:
        """The registered formats as a phrase: "a, b or c"."""
        *rest, last = self.formats
        return f"{', '.join(rest)} or {last}" if rest else last
