"""Logging setup shared by the CLI and the processes it starts: one format, one level, which the
libraries' loggers follow (uvicorn's access log, httpx), save uvicorn's own start and stop lines,
shown only at DEBUG."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(level: int | str) -> None:
    """Logs at `level` and above to stderr, one line per record. uvicorn's server logger
    ("Started server process", "Application startup complete", ...) logs warnings and errors
    only, unless `level` is DEBUG; pass uvicorn `log_config=None, log_level=None` so its loggers
    keep these levels and this format."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    numeric = logging.getLogger().getEffectiveLevel() if isinstance(level, str) else level
    for name in ("uvicorn.access", "httpx"):
        logging.getLogger(name).setLevel(numeric)
    logging.getLogger("uvicorn.error").setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
