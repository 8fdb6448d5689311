"""Logging setup shared by the CLI and the processes it starts."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


def configure_logging(level: int | str) -> None:
    """Logs at `level` and above to stderr, one line per record."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
