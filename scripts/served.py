"""What the server benchmarks in scripts/ share: waiting for a `nanoserve serve` they launched to
become healthy, then warming its prompt workers."""

from __future__ import annotations

import subprocess

import httpx

from nanoserve.bench import served


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    """Returns once `url`/health answers 200, then sends one short chat completion so the template
    workers have started; SystemExit if the server exits or is not healthy within `timeout_s`."""
    try:
        served.wait_healthy(url, server, timeout_s)
    except RuntimeError as e:
        raise SystemExit(f"the server {e}") from None
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
