"""The tool-call formats nanoserve parses, by name (`TOOL_PARSERS`), and the parser a server
configured with a `--tool-call-parser` name uses for a model.

Adding a format is a module with its parser class (a `ToolCallParser`) and one entry here: its
name, the class, the markers that show it in a chat template and a summary for the CLI help. The
names the server and the CLI accept, "auto" detection and the errors all follow from the entries
(see `parser_registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.server.chat.parser_registry import ParserRegistry
from nanoserve.server.chat.tool_parsers.calls import ToolCallParser
from nanoserve.server.chat.tool_parsers.hermes import HermesParser
from nanoserve.server.chat.tool_parsers.llama3_json import Llama3JsonParser
from nanoserve.server.chat.tool_parsers.mistral import MistralParser


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A registered tool-call format: its parser, the markers a chat template of it contains (all
    of them) and a few words for the CLI help."""

    parser: type[ToolCallParser]
    markers: tuple[str, ...]
    summary: str


TOOL_PARSERS = ParserRegistry("tool-call parser", {
    "hermes": ToolFormat(HermesParser, markers=(HermesParser.START,), summary="<tool_call> JSON, Qwen"),
    "llama3_json": ToolFormat(Llama3JsonParser, markers=(Llama3JsonParser.TAG,), summary="Llama 3.x"),
    "mistral": ToolFormat(MistralParser, markers=(MistralParser.TAG,), summary="[TOOL_CALLS]"),
})
PARSER_NAMES = TOOL_PARSERS.names


def parser_factory(name: str, chat_template: str | None) -> type[ToolCallParser] | None:
    """The parser class for `--tool-call-parser`: "auto" reads the chat template, and a template
    that shows no registered format (or "none") has no parser (None)."""
    chosen = TOOL_PARSERS.choose(name, chat_template)
    return None if chosen is None else TOOL_PARSERS[chosen].parser
