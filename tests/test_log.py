"""`nanoserve.log.Progress`: a bar on a terminal, a line every few seconds in a log, never both."""

from __future__ import annotations

import logging
import sys

import pytest

from nanoserve.log import Progress

log = logging.getLogger("tests.progress")


def test_in_a_log_progress_is_lines_not_a_bar(caplog: pytest.LogCaptureFixture,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO)
    with Progress(4 << 20, "loading weights", log, interval_s=0.0) as progress:
        for _ in range(4):
            progress.update(1 << 20)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and lines[-1].startswith("loading weights: 4 of 4 MiB (100%")
    assert capsys.readouterr().err == ""
    caplog.clear()
    with Progress(4 << 20, "loading weights", log, interval_s=3600.0) as progress:
        progress.update(4 << 20)
    assert caplog.records == []  # a quick load says nothing


def test_on_a_terminal_progress_is_a_bar(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    caplog.set_level(logging.INFO)
    with Progress(4 << 20, "loading weights", log, interval_s=0.0) as progress:
        progress.update(4 << 20)
    assert caplog.records == [] and "loading weights: 100%" in capsys.readouterr().err
    with Progress(4 << 20, "loading weights", log, interval_s=0.0, shown=False) as progress:
        progress.update(4 << 20)
    assert caplog.records == [] and capsys.readouterr().err == ""
