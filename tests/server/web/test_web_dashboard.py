"""The dashboard (`/dashboard`) in a real headless Chromium against a real server on a loopback port.

The page must show what the engine holds while a load runs (blocks in use, running sequences,
steps, rates) and return to idle after it, reading only its stats stream; with an API key it asks
for the key and then connects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from nanoserve.engine.llm_engine import LLMEngine

from support.server import background_load, pace, serve, wait_idle

pytestmark = [pytest.mark.browser, pytest.mark.slow]

API_KEY = "dashboard-test-key"
Page = Any  # playwright.sync_api.Page (the package is imported only where a browser exists)


def _count(page: Page, element_id: str) -> int:
    """An integer the page shows (thousands separators dropped; "–" is no value yet: -1)."""
    text = page.locator(f"#{element_id}").inner_text().replace(",", "").replace("\u202f", "").strip()
    return int(text) if text.isdigit() else -1


def _wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard never showed {what}")
        time.sleep(0.05)


def test_blocks_fill_while_a_load_runs_and_the_page_returns_to_idle(
        engine: LLMEngine, browser_page: Page, monkeypatch: pytest.MonkeyPatch) -> None:
    pace(engine, monkeypatch, 0.03)  # the load spans many stats records
    with serve(engine) as (url, app):
        page = browser_page
        page.goto(f"{url}/dashboard")
        _wait_until(lambda: page.locator("#status").inner_text() == "live" and _count(page, "n-free") >= 0,
                    10, "a live stream")
        assert _count(page, "n-used") == 0 and _count(page, "t-running") == 0
        assert _count(page, "n-free") + _count(page, "n-cached") == engine.num_blocks

        load = background_load(url, 8, 48)
        seen_used = seen_running = seen_rows = 0
        while load.is_alive():
            seen_used = max(seen_used, _count(page, "n-used") + _count(page, "n-pinned"))
            seen_running = max(seen_running, _count(page, "t-running"))
            seen_rows = max(seen_rows, page.locator("#running tr").count())
            time.sleep(0.05)
        load.join()
        assert seen_used > 0, "no block was ever shown in use during the load"
        assert seen_running > 1, "the running queue never showed the concurrent requests"
        assert seen_rows > 1, "the running table never listed the sequences"

        wait_idle(app)
        _wait_until(lambda: _count(page, "n-used") == 0 and _count(page, "n-pinned") == 0
                    and _count(page, "t-running") == 0 and _count(page, "t-waiting") == 0, 10, "idle after the load")
        assert _count(page, "n-cached") > 0  # the prompts stay in the prefix cache
        assert page.locator("#running tr").count() == 0
        assert page.locator("#t-gen").inner_text() != "–"  # the rates reached the page


def test_the_page_asks_for_the_api_key_then_connects(engine: LLMEngine, browser_page: Page) -> None:
    with serve(engine, api_key=API_KEY) as (url, _):
        page = browser_page
        page.goto(f"{url}/dashboard")
        page.locator("#key-form").wait_for(state="visible")
        assert page.locator("#status").inner_text() == "API key needed"
        page.locator("#key-input").fill("wrong")
        page.locator("#key-input").press("Enter")
        _wait_until(lambda: page.locator("#status").inner_text() == "wrong API key", 10, "the wrong key refused")
        page.locator("#key-input").fill(API_KEY)
        page.locator("#key-input").press("Enter")
        _wait_until(lambda: page.locator("#status").inner_text() == "live", 10, "a live stream with the key")
        background_load(url, 2, 8, {"Authorization": f"Bearer {API_KEY}"}).join()
        _wait_until(lambda: _count(page, "n-cached") > 0, 10, "the finished requests' cached blocks")
