"""The `nanoserve` command: generate, serve, chat, bench.

Parsing imports no torch: only the chosen subcommand's parser is built in full (the others are
listed by name and help), each subcommand module imports its heavy parts inside its `run`, and
`--help` and `--version` answer before anything is loaded. Errors a user can fix are one line on
stderr and exit status 2; `--log-level DEBUG` adds the traceback."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

from nanoserve.log import LOG_LEVELS, configure_logging
from nanoserve.settings import DefaultsFormatter, SettingsError, apply_settings

# Each subcommand and its one-line help (its module, nanoserve.commands.<name>, has `register`).
COMMANDS = {
    "generate": "generate a continuation of a prompt",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "chat": "chat with a model in the terminal",
    "bench": "benchmarks",
}

log = logging.getLogger(__name__)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv`: the subcommand it names (if any) registered in full, the others by
    name; without `argv`, every subcommand in full. The defaults of the registered subcommands'
    flags are moved to the environment's and their --config file's values (SettingsError)."""
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument("--log-level", type=str.upper, default="INFO", choices=LOG_LEVELS,
                        help="log records at this level and above, the libraries' (uvicorn, httpx) too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    chosen = None if argv is None else _chosen_command(argv)
    for name, text in COMMANDS.items():
        if argv is None or name == chosen:
            before = set(sub.choices)
            importlib.import_module(f"nanoserve.commands.{name}").register(sub)
            for registered in set(sub.choices) - before:
                _format_defaults(sub.choices[registered])
                apply_settings(sub.choices[registered], argv or [])
        else:
            sub.add_parser(name, help=text)
    apply_settings(parser, None)
    return parser


class _Version(argparse.Action):
    """--version: the installed package's version, read (importlib.metadata) only when asked."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(f"{parser.prog} {importlib.metadata.version('nanoserve')}")
        parser.exit()


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand in `argv`: its first word that is not an option of the top-level parser."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _format_defaults(parser: argparse.ArgumentParser) -> None:
    """Gives `parser` and the parsers below it the help formatter that states every default."""
    parser.formatter_class = DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _format_defaults(child)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns = build_parser(argv).parse_args(argv)
    except SettingsError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2
    configure_logging(ns.log_level)
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:  # Ctrl-C before a command handles it itself (e.g. while `serve` imports)
        print("nanoserve: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_user_error(e):
            raise
        log.debug("the command failed", exc_info=True)
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


def _is_user_error(e: Exception) -> bool:
    """Errors whose message says what to fix (a bad flag, a model that cannot be loaded)."""
    from nanoserve.model.config import ModelLoadError, UnsupportedModelError

    return isinstance(e, ModelLoadError | UnsupportedModelError | ValueError | OSError)


if __name__ == "__main__":
    sys.exit(main())
