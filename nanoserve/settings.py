"""Where a subcommand's flag values come from: the command line, then `NANOSERVE_<FLAG>` environment
variables, then a YAML file given by `--config`, then the defaults written in the parser (vLLM's
`--config` convention: the file's keys are flag names, with dashes or underscores).

Invariants:
- Every value from the environment or the file goes through the flag's own type and choices
  before anything runs; a bad one is a `SettingsError` naming its source (the variable, or the
  file and key), as is a key of the file that names no flag of the command.
- The environment and the file only move a flag's default (`parser.set_defaults`), so the command
  line still wins and `--help` shows the value that applies.
- Imports nothing heavy: the parsers are built without torch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "NANOSERVE_"
PRECEDENCE = ("Each flag may also be set in a YAML file given by --config (its keys are flag names, with "
              f"dashes or underscores) or by an environment variable {ENV_PREFIX}<FLAG> (e.g. "
              f"{ENV_PREFIX}MAX_NUM_SEQS=8; a flag of several values takes them separated by spaces, a switch "
              "true or false); the command line wins over the environment, the environment over the file, "
              "the file over the defaults shown.")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingsError(ValueError):
    """A value from the environment or a config file that its flag does not take."""


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to a flag's help unless the help already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or "default:" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is None and (action.option_strings or action.nargs in ("?", "*")):
            return f"{text} (default: none)".strip()
        return super()._get_help_string(action)


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="a YAML file of flag values (keys: flag names); see the note below (default: none)")
    parser.epilog = PRECEDENCE


def settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions a file or the environment may set, by dest (--help, --version,
    --config and subcommands aside)."""
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    return {a.dest: a for a in parser._actions if a.dest != "config" and not isinstance(a, skip)}


def apply_settings(parser: argparse.ArgumentParser, argv: list[str] | None,
                   environ: Mapping[str, str] | None = None) -> None:
    """Moves the defaults of `parser` to the values of the `--config` file named in `argv` (None: a
    parser without --config), then to those of the environment (`os.environ` unless given).
    Raises SettingsError."""
    environ = os.environ if environ is None else environ
    actions = settable(parser)
    layered: dict[str, Any] = {}
    takes_file = any(a.dest == "config" for a in parser._actions)
    config = _config_path(argv, environ) if argv is not None and takes_file else None
    if config is not None:
        for key, value in _read_yaml(config).items():
            dest = str(key).replace("-", "_")
            if dest not in actions:
                raise SettingsError(f"{config}: {key!r} is not a flag of `{parser.prog}`")
            layered[dest] = _convert(actions[dest], value, f"{config}: {key}")
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            layered[dest] = _convert(action, environ[name], name)
    parser.set_defaults(**layered)


def _config_path(argv: list[str], environ: Mapping[str, str]) -> Path | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    path = known.config or environ.get(ENV_PREFIX + "CONFIG")
    return None if path is None else Path(path)


def _read_yaml(path: Path) -> dict[Any, Any]:
    import yaml  # type: ignore[import-untyped]

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SettingsError(f"cannot read the config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise SettingsError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    """`value` (a string from the environment, or YAML's scalar or list) as the flag would parse it."""
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction):
        return _boolean(value, source)
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if many:
        items = value.split() if isinstance(value, str) else value if isinstance(value, list) else [value]
        out: Any = [_one(action, v, source) for v in items]
        if isinstance(action.nargs, int) and len(out) != action.nargs:
            raise SettingsError(f"{source}: expected {action.nargs} values, got {len(out)}")
        return out
    if isinstance(value, list | dict):
        raise SettingsError(f"{source}: expected one value, got {value!r}")
    return None if value is None else _one(action, value, source)


def _one(action: argparse.Action, value: Any, source: str) -> Any:
    kind = action.type if callable(action.type) else str
    try:
        out = kind(str(value))
    except (TypeError, ValueError) as e:
        raise SettingsError(f"{source}: invalid value {value!r} ({e})") from e
    if action.choices is not None and out not in action.choices:
        raise SettingsError(f"{source}: invalid choice {out!r} (choose from {', '.join(map(str, action.choices))})")
    return out


def _boolean(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingsError(f"{source}: expected true or false, got {value!r}")
