"""Writes docs/chat.png: the chat page in headless Chromium, after real conversations with the demo
model streamed through a real server on a loopback port.

    PYTHONPATH=. python scripts/screenshot_chat.py [--out docs/chat.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tests/support/browser.py: finding and launching Chromium

from browser import launch_chromium, unavailable_reason  # noqa: E402

from nanoserve.engine.args import EngineArgs  # noqa: E402
from nanoserve.runtime.builder import build_engine  # noqa: E402
from nanoserve.server import ServerConfig, build_app  # noqa: E402
from nanoserve.server.http_server import ServerThread  # noqa: E402

CONVERSATIONS = [
    ["What is the weather like in the mountains?"],
    ["Tell me about the sea.", "What do people eat for breakfast?", "Why do birds sing in the morning?"],
]
SETTINGS = [("system-prompt", "You are a friendly assistant."), ("temperature", "0.3"), ("top-p", "0.95"),
            ("max-tokens", "80"), ("seed", "1")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "chat.png")
    args = parser.parse_args()
    if reason := unavailable_reason():
        sys.exit(f"no browser: {reason}")
    app = build_app(build_engine(EngineArgs()), ServerConfig())
    with ServerThread(app) as server, launch_chromium() as browser:
        server.wait_healthy()
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(f"{server.url}/")
        page.locator("#model:not(:has-text('connecting'))").wait_for()
        page.get_by_test_id("settings-toggle").click()
        for field, value in SETTINGS:
            page.get_by_test_id(field).fill(value)
        for i, turns in enumerate(CONVERSATIONS):
            if i:
                page.get_by_test_id("new-chat").click()
            for text in turns:
                page.get_by_test_id("input").fill(text)
                page.get_by_test_id("input").press("Enter")
                page.locator('body[data-busy="false"] .msg.assistant[data-state]').last.wait_for()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
