"""A real headless Chromium for the web pages' tests, driven by Playwright's Python package.

Playwright drives the system's Chromium (Debian's `chromium` package) through `executable_path`;
its own browser downloads are never used. `find_chromium` says where the browser is, and
`unavailable_reason` why the browser tests cannot run (None when they can): they skip only then.
A browser that exists but fails to start is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM_ENV = "NANOSERVE_CHROMIUM"  # an explicit browser binary, overriding the search below
CHROMIUM_NAMES = ("chromium", "chromium-browser")
LAUNCH_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync")


def find_chromium() -> str | None:
    """The Chromium binary: $NANOSERVE_CHROMIUM if set, else the first of CHROMIUM_NAMES on PATH."""
    if explicit := os.environ.get(CHROMIUM_ENV):
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def unavailable_reason() -> str | None:
    """Why no browser can be had here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -e '.[test]')"
    if find_chromium() is None:
        where = os.environ.get(CHROMIUM_ENV)
        if where:
            return f"${CHROMIUM_ENV}={where} is not an executable"
        return ("no Chromium on PATH (chromium, chromium-browser): install Debian's package "
                f"(apt-get install chromium) or set ${CHROMIUM_ENV}")
    return None


@contextmanager
def launch_chromium() -> Iterator[Browser]:
    """A headless Chromium, closed on exit. Call only when `unavailable_reason()` is None."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    assert executable is not None, unavailable_reason()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=list(LAUNCH_ARGS))
        try:
            yield browser
        finally:
            browser.close()
