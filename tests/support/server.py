"""Helpers for the server tests (no tests here): a demo engine served on a loopback port, a wait
for the KV pool to be free again, a strict parser of SSE bytes, and the ways a test orders the
engine's steps against its clients (`hold_after_first_output`, `gate_steps`) instead of racing them."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import StepOutput
from nanoserve.runtime.builder import build_engine
from nanoserve.server import ServerConfig, build_app
from nanoserve.server.http_server import ServerThread

SERVED = "demo"
ENGINE_ARGS: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 128}


def make_engine(demo_dir: Path, **overrides: Any) -> LLMEngine:
    return build_engine(EngineArgs(model=str(demo_dir), **{**ENGINE_ARGS, **overrides}))


@contextmanager
def serve(engine: LLMEngine, **config: Any) -> Iterator[tuple[str, FastAPI]]:
    """The engine behind a fresh app on a free loopback port: (base url, app)."""
    app = build_app(engine, ServerConfig(**{"served_model_name": SERVED, **config}))
    with ServerThread(app) as server:
        server.wait_healthy(timeout=60)
        yield server.url, app


def pace(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, seconds: float = 0.02) -> None:
    """Makes every engine step take at least `seconds`, so that what a test needs to overlap
    (streams, disconnects, a table of requests) overlaps however fast the machine is."""
    step = engine.step

    def paced_step() -> Any:
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)


class Hold(threading.Event):
    """What `hold_steps` returns: set it to let the engine go on. `expired` turns true if the hold
    lasted its whole timeout and let the engine go on by itself: a test that then checks what it
    saw held must fail saying so, not on what the engine did meanwhile."""

    expired: bool = False


def hold_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool],
               timeout: float = 120.0) -> Hold:
    """Makes the engine take no step while `when()` (called on the engine's thread before each step)
    is true, until the returned event is set or the hold has lasted `timeout` seconds. A held step
    waits a little and returns no output, so the engine's loop goes on taking commands: requests
    added wait, aborts are applied and free their blocks. Whatever the machine's load, what a test
    saw running is still running, at the same point, until the test lets the engine go on."""
    step = engine.step
    release = Hold()
    held_since: float | None = None

    def held_step() -> StepOutput:
        nonlocal held_since
        if not release.is_set() and when():
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since < timeout:
                time.sleep(0.005)
                return StepOutput([])
            release.expired = True
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    return release


def hold_after_first_output(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Hold:
    """`hold_steps` once the engine has generated a token: a request that has streamed its first
    output is still running until the test sets the returned event."""
    start = engine.num_generated_tokens
    return hold_steps(engine, monkeypatch, lambda: engine.num_generated_tokens > start)


def gate_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, ready: Callable[[], bool],
               timeout: float = 120.0) -> None:
    """`hold_steps` until `ready()` is first true (or `timeout` has passed), then steps as usual:
    what a test needs in the engine together is all there before the first step, however the
    machine's load spaces the requests' arrivals."""
    opened = False

    def closed() -> bool:
        nonlocal opened
        opened = opened or ready()
        return not opened

    hold_steps(engine, monkeypatch, closed, timeout)


def post_and_hang_up(url: str, path: str, body: dict[str, Any], until: Callable[[], bool],
                     headers: dict[str, str] | None = None, timeout: float = 60.0) -> None:
    """POSTs `body` as JSON on a socket of its own and closes the connection, unanswered, once
    `until()` is true: a client that leaves at a point the test chooses, not after a timeout."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = {"Host": host, "Content-Type": "application/json", "Content-Length": str(len(payload)), **(headers or {})}
    fields = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    request = f"POST {path} HTTP/1.1\r\n{fields}\r\n"
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, int(port)), timeout=timeout) as client:
        client.sendall(request.encode() + payload)
        while not until():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)


def wait_idle(app: FastAPI, timeout: float = 20.0) -> None:
    """Waits until the engine holds no request and every KV block is free (or only cached)."""
    engine = app.state.engine
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot
        if snap.num_running == 0 and snap.num_waiting == 0 and snap.kv.blocks_used == 0:
            return
        assert time.monotonic() < deadline, f"the engine is not idle: {snap}"
        time.sleep(0.02)


def sse_payloads(raw: bytes) -> list[Any]:
    """The JSON payloads of an OpenAI SSE body, checking the framing byte for byte: every event
    is exactly `data: <compact json>\\n\\n` and the body ends with `data: [DONE]\\n\\n`."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    frames = raw[: -len(b"data: [DONE]\n\n")].split(b"\n\n")
    assert frames[-1] == b""
    payloads = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
        payload = json.loads(frame[len(b"data: "):])
        assert frame == b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        payloads.append(payload)
    return payloads


def _sample(text: str) -> tuple[str, dict[str, str]]:
    """A sample's name and labels, from `name{label="value",...}`."""
    base, _, labels = text.partition("{")
    return base, dict(re.findall(r'(\w+)="([^"]*)"', labels))


def metric_value(text: str, name: str) -> float:
    """The value of the first sample line of a Prometheus text page with this name and at least
    the labels `name` gives (`name{label="value"}`; a label it does not give may have any value)."""
    want, labels = _sample(name)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample, value = line.rsplit(" ", 1)
        base, have = _sample(sample)
        if base == want and labels.items() <= have.items():
            return float(value)
    raise AssertionError(f"no sample {name}")


def background_load(url: str, n: int, max_tokens: int, headers: dict[str, str] | None = None) -> threading.Thread:
    """n concurrent completions on a background thread (started)."""

    def one(i: int) -> None:
        r = httpx.post(f"{url}/v1/completions", timeout=120, headers=headers, json={
            "prompt": f"Request {i}: " + "the quick brown fox " * 6, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def run() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    thread = threading.Thread(target=run)
    thread.start()
    return thread
