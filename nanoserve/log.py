"""Logging setup shared by the CLI and the processes it starts: one format, one level, which the
libraries' loggers follow (uvicorn's access log, httpx), save uvicorn's own start and stop lines,
shown only at DEBUG; and progress that draws a bar on a terminal and writes a line every few
seconds into a log (`Progress`)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_logging(level: int | str) -> None:
    """Logs at `level` and above to stderr, one line per record. uvicorn's server logger
    ("Started server process", "Application startup complete", ...) logs warnings and errors
    only, unless `level` is DEBUG; pass uvicorn `log_config=None, log_level=None` so its loggers
    keep these levels and this format."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    numeric = logging.getLevelNamesMapping()[level] if isinstance(level, str) else level
    for name in ("uvicorn.access", "httpx"):
        logging.getLogger(name).setLevel(numeric)
    logging.getLogger("uvicorn.error").setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))


class Progress:
    """Progress through `total` bytes: a tqdm bar when stderr is a terminal, else (a log file, a
    pipe) one log line at most every `interval_s` seconds and one at the end, so a log never fills
    with a bar's redraws; nothing at all unless `shown`. Use as a context manager; `update(n)`
    adds n bytes."""

    def __init__(self, total: int, desc: str, logger: logging.Logger, interval_s: float = 5.0,
                 shown: bool = True) -> None:
        self.total, self.desc, self.log, self.interval_s, self.shown = total, desc, logger, interval_s, shown
        self.done = 0
        self._bar: Any = None
        self._started = self._last = time.monotonic()

    def __enter__(self) -> Progress:
        if self.shown and sys.stderr.isatty():
            from tqdm import tqdm  # type: ignore[import-untyped]

            self._bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=self.desc)
        return self

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.shown and (now := time.monotonic()) - self._last >= self.interval_s:
            self._last = now
            self._line()

    def _line(self) -> None:
        self.log.info("%s: %.0f of %.0f MiB (%.0f%%, %.0f s)", self.desc, self.done / 2**20, self.total / 2**20,
                      100 * self.done / max(self.total, 1), time.monotonic() - self._started)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.shown and exc[0] is None and time.monotonic() - self._started >= self.interval_s:
            self._line()
