"""The tool-call and reasoning parser registries: every registered name is accepted by the CLI
and the server config, an unknown name is refused with exactly the registry's names, and "auto"
finds each registered format in a chat template that holds its markers. Every case is drawn from
the registries, so a new entry is covered as soon as it is registered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nanoserve import cli
from nanoserve.server import ServerConfig
from nanoserve.server.chat.parser_registry import ParserRegistry
from nanoserve.server.chat.reasoning_parsers import REASONING_PARSERS, ReasoningFormat, reasoning_parser_name
from nanoserve.server.chat.tool_parsers.calls import join_calls
from nanoserve.server.chat.tool_parsers.registry import TOOL_PARSERS, ToolFormat, parser_factory

KINDS = [(TOOL_PARSERS, "--tool-call-parser", "tool_call_parser"),  # (registry, CLI flag, ServerConfig field)
         (REASONING_PARSERS, "--reasoning-parser", "reasoning_parser")]
NAMES = [(flag, field, name) for registry, flag, field in KINDS for name in registry.names]
FORCED = [(name, fmt) for name, fmt in TOOL_PARSERS.items() if fmt.parser.forced_format is not None]


def _template(markers: tuple[str, ...]) -> str:
    """A chat template that writes these markers among other text."""
    return "{%- for m in messages %}{{ m.content }}" + "\n".join(markers) + "{%- endfor %}"


def _listed(error: str) -> tuple[str, ...]:
    """The names an unknown-name error offers."""
    return tuple(error.split("choose one of ", 1)[1].split(", "))


@pytest.mark.parametrize(("flag", "field", "name"), NAMES, ids=[f"{flag}={name}" for flag, _, name in NAMES])
def test_every_registered_name_is_accepted(flag: str, field: str, name: str) -> None:
    assert getattr(cli.build_parser().parse_args(["serve", flag, name]), field) == name
    assert getattr(ServerConfig(**{field: name}), field) == name


@pytest.mark.parametrize(("registry", "flag", "field"), KINDS, ids=[flag for _, flag, _ in KINDS])
def test_the_cli_offers_exactly_the_registrys_names(registry: ParserRegistry[Any], flag: str, field: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    assert f"{flag} {{{','.join(registry.names)}}}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", flag, "no-such-parser"])


@pytest.mark.parametrize(("registry", "flag", "field"), KINDS, ids=[flag for _, flag, _ in KINDS])
def test_an_unknown_name_is_refused_with_the_registrys_names(registry: ParserRegistry[Any], flag: str,
                                                              field: str) -> None:
    with pytest.raises(ValueError, match=f"unknown {registry.kind} 'no-such-parser'") as config_error:
        ServerConfig(**{field: "no-such-parser"})
    with pytest.raises(ValueError) as choose_error:
        registry.choose("no-such-parser", None)
    assert _listed(str(config_error.value)) == _listed(str(choose_error.value)) == registry.names
    assert registry.names == ("auto", *registry, "none")


@pytest.mark.parametrize(("name", "fmt"), TOOL_PARSERS.items(), ids=list(TOOL_PARSERS))
def test_auto_detects_each_tool_format(name: str, fmt: ToolFormat) -> None:
    assert parser_factory("auto", _template(fmt.markers)) is fmt.parser
    assert parser_factory(name, None) is fmt.parser
    assert parser_factory("auto", _template(())) is None


@pytest.mark.parametrize(("name", "fmt"), REASONING_PARSERS.items(), ids=list(REASONING_PARSERS))
def test_auto_detects_each_reasoning_format(name: str, fmt: ReasoningFormat) -> None:
    assert reasoning_parser_name("auto", _template(fmt.markers)) == name
    assert reasoning_parser_name(name, None) == name
    assert reasoning_parser_name("auto", _template(())) is None


@pytest.mark.parametrize(("name", "fmt"), FORCED, ids=[name for name, _ in FORCED])
def test_a_forced_call_reads_back_as_calls(name: str, fmt: ToolFormat) -> None:
    """Text written the way a format's forced-call grammar writes calls is those calls to its parser."""
    forced = fmt.parser.forced_format
    assert forced is not None
    calls = [("get_time", {}), ("get_weather", {"city": "Paris"})]
    text = forced.between.join("".join(json.dumps({"name": n, forced.arguments_key: a}) if p is None else p
                                       for p in forced.pieces) for n, a in calls)
    parser = fmt.parser()
    first, last = parser.push(text), parser.finish()
    assert first.content + last.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in join_calls(first.calls + last.calls)] == calls


@pytest.mark.parametrize("registry", [TOOL_PARSERS, REASONING_PARSERS], ids=["tool", "reasoning"])
def test_a_registry_cannot_change(registry: ParserRegistry[Any]) -> None:
    with pytest.raises(TypeError):
        registry.formats["new"] = next(iter(registry.values()))
