"""The dashboard (`/dashboard`) in a real headless Chromium against a real server on a loopback port.

The page must show what the engine holds while a load runs (blocks in use, running sequences,
steps, rates) and return to idle after it, reading only its stats stream; with an API key it asks
for the key and then connects.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.builder import build_engine

from support.moe import save_tiny_moe
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
        assert page.locator("#experts-panel").is_hidden()  # a dense model
        page.goto("about:blank")  # the stream closes now, not at the server's graceful-shutdown timeout


def test_the_expert_panel_of_a_mixture_of_experts(demo_dir: Path, tmp_path: Path, browser_page: Page) -> None:
    """A tiny Qwen3-MoE (8 experts, top 2, 2 layers): the panel shows, and after a load its figures
    lie where routing puts them: at least k and at most E experts read per layer, a busiest share
    in (0, 100] %, one bar per expert."""
    path = save_tiny_moe(tmp_path / "moe", demo_dir, "Qwen3Moe", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32, num_key_value_heads=2))
    engine = build_engine(EngineArgs(model=str(path), dtype="float32", num_kv_blocks=64, max_model_len=128))
    with serve(engine) as (url, _):
        page = browser_page
        page.goto(f"{url}/dashboard")
        page.locator("#experts-panel").wait_for(state="visible")
        assert page.locator("#experts-caption").inner_text() == "8 experts in 2 layers"
        background_load(url, 2, 8).join()
        _wait_until(lambda: page.locator("#e-layer").inner_text() != "–", 10, "the experts read per layer")
        assert 2 <= float(page.locator("#e-layer").inner_text()) <= 8
        assert 4 <= float(page.locator("#e-read").inner_text()) <= 16
        share = float(page.locator("#e-busiest").inner_text().removesuffix(" %"))
        assert 0 < share <= 100
        page.goto("about:blank")  # the stream closes now, not at the server's graceful-shutdown timeout


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
        page.goto("about:blank")
