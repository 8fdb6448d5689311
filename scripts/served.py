"""What the server benchmarks in scripts/ share: waiting for a `nanoserve serve` they launched to
become healthy, then warming its prompt workers."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Returns once `url`/health answers 200, then sends one short chat completion so the template
    workers have started; SystemExit if the server exits or is not healthy within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become healthy")
        time.sleep(0.2)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
