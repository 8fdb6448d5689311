"""The `nanoserve` command: generate, serve, chat, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from nanoserve.log import configure_logging
from nanoserve.model import ModelLoadError, UnsupportedModelError

COMMANDS = ("generate", "serve", "chat", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"nanoserve.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    configure_logging(ns.log_level)
    try:
        return ns.func(ns)
    except (ModelLoadError, UnsupportedModelError, ValueError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
