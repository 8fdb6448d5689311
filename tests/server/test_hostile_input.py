"""Hostile input against a real server: a chat template that never ends, one that builds huge values
or prints internals, and prompts far too long to fit. Each is a 400 naming `messages` or `prompt`;
another client's stream goes on without a stall meanwhile, and the server stays fully usable.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from support.server import SERVED, hold_after_first_output, make_engine, pace, serve, sse_payloads, wait_idle

TEMPLATE = (
    "{%- set last = messages[-1].content -%}"
    "{%- if last == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- elif last == 'big' %}{{ 'x' * 10**7 }}"
    "{%- elif last == 'leak' %}{{ raise_exception }}{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
PROMPT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def hostile_model(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(demo_dir, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture
def server(hostile_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, FastAPI]]:
    engine = make_engine(hostile_model)
    pace(engine, monkeypatch, 0.04)  # the other client's stream outlasts the template's deadline
    with serve(engine, prompt_timeout_s=PROMPT_TIMEOUT_S) as (url, app):
        yield url, app
        wait_idle(app)


def _chat(url: str, content: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": SERVED, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                            **body})


class _Stream(threading.Thread):
    """Another user's completion stream, with the time each of its chunks arrived."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.arrivals, self.started = url, list[float](), threading.Event()

    def run(self) -> None:
        body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.monotonic())
                    self.started.set()

    def longest_gap(self) -> float:
        return max(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))


def test_a_template_that_never_ends_is_stopped_while_another_stream_flows(server: tuple[str, FastAPI]) -> None:
    url, _ = server
    other = _Stream(url)
    other.start()
    assert other.started.wait(30)
    health: list[float] = []
    t0 = time.monotonic()
    r = _chat(url, "spin")
    took = time.monotonic() - t0
    for _ in range(3):
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - start)
    other.join(60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "took more than 2 s" in r.json()["error"]["message"]
    assert PROMPT_TIMEOUT_S <= took < PROMPT_TIMEOUT_S + 10
    during = [t for t in other.arrivals if t0 < t < t0 + took]
    assert len(during) > 10 and other.longest_gap() < 1.0, other.longest_gap()  # it flowed all along
    assert max(health) < 1.0
    ok = _chat(url, "hello")  # the template worker was replaced
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("content", "match"), [
    ("big", "more than 1048576 items"),
    ("leak", "print a function"),
])
def test_templates_that_build_huge_values_or_print_internals_are_400(server: tuple[str, FastAPI], content: str,
                                                                      match: str) -> None:
    url, _ = server
    r = _chat(url, content)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert match in r.json()["error"]["message"]
    assert _chat(url, "hello").status_code == 200


def test_prompts_too_long_to_fit_are_400_before_any_work(server: tuple[str, FastAPI]) -> None:
    url, _ = server
    huge = "lorem ipsum " * 400_000  # 4.8 MB, against a 128-token context
    r = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": huge, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "characters long, more than could fit the context" in r.json()["error"]["message"]
    r = _chat(url, huge)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{url}/tokenize", json={"model": SERVED, "prompt": huge}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert _chat(url, "hello").status_code == 200


def test_a_full_queue_answers_429_before_rendering_anything(hostile_model: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """One request runs, one waits (the queue's bound): a third, whose template would spin until
    its deadline, gets its 429 at once, without being rendered."""
    engine = make_engine(hostile_model, max_num_seqs=1)
    pace(engine, monkeypatch, 0.05)
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 60, "stream": True, "ignore_eos": True}
    with serve(engine, max_queued_requests=1, prompt_timeout_s=PROMPT_TIMEOUT_S) as (url, app), \
            contextlib.ExitStack() as streams:

        def until(done: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 30
            while not done():
                assert time.monotonic() < deadline
                time.sleep(0.02)

        streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60))
        until(lambda: app.state.engine.snapshot.num_running == 1)
        streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60))
        until(lambda: app.state.engine.snapshot.num_waiting == 1)
        t0 = time.monotonic()
        r = _chat(url, "spin")
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert time.monotonic() - t0 < PROMPT_TIMEOUT_S  # refused before its template ran
    wait_idle(app)


def test_the_queue_bound_counts_sequences_not_requests(hostile_model: Path, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """With room for 8 waiting sequences, a request for 128 choices gets its 429 at once (before
    its template, which would spin to its deadline, is rendered), as does one of 2 prompts times 5;
    a request of exactly 8 choices runs, and while 7 of its sequences wait (one runs at a time),
    a request for 2 more is refused."""
    engine = make_engine(hostile_model, max_num_seqs=1)
    release = hold_after_first_output(engine, monkeypatch)
    with serve(engine, max_queued_requests=8, prompt_timeout_s=PROMPT_TIMEOUT_S) as (url, app):
        t0 = time.monotonic()
        r = _chat(url, "spin", n=128)
        assert r.status_code == 429, r.text
        assert time.monotonic() - t0 < PROMPT_TIMEOUT_S
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert "0 sequences are waiting and this request adds 128" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": SERVED, "prompt": ["a", "b"], "n": 5, "max_tokens": 2})
        assert r.status_code == 429 and "this request adds 10" in r.json()["error"]["message"]
        body = {"model": SERVED, "messages": [{"role": "user", "content": "hello"}], "n": 8, "max_tokens": 2,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as eight:
            assert eight.status_code == 200
            deadline = time.monotonic() + 30
            while app.state.engine.snapshot.num_waiting_seqs != 7:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = _chat(url, "hello", n=2)
            assert r.status_code == 429 and "7 sequences are waiting and this request adds 2" in r.text
            release.set()
            choices = {c["index"] for p in sse_payloads(eight.read()) for c in p["choices"]}
        assert choices == set(range(8))
        wait_idle(app)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_body_over_the_limit_is_413_before_parsing(demo_dir: Path, path: str) -> None:
    engine = make_engine(demo_dir)
    big = {"model": SERVED, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 100_000}]}
    with serve(engine, max_body_bytes=65_536) as (url, app):
        r = httpx.post(f"{url}{path}", json=big, timeout=60)
        assert r.status_code == 413, r.text
        assert "larger than 65536 bytes" in r.text
        if path == "/v1/messages":
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "request_too_large"
        else:
            assert r.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the bound holds as the bytes arrive
            yield b'{"model": "' + SERVED.encode() + b'", "messages": [{"role": "user", "content": "'
            for _ in range(100):
                yield b"x" * 1000
            yield b'"}]}'

        r = httpx.post(f"{url}{path}", content=chunks(), timeout=60)
        assert r.status_code == 413, r.text
        small = {**big, "messages": [{"role": "user", "content": "hello"}]}
        assert httpx.post(f"{url}/v1/chat/completions", json=small, timeout=60).status_code == 200
        wait_idle(app)
