"""What a connection may hold (nanoserve.server.connection_limits), against a real server on
loopback: slowloris connections are cut at the header deadline while another client streams, an
idle keep-alive connection is closed, and a connection past the cap gets a 503 in the API's shape
while the open ones go on."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from nanoserve.server import ServerConfig, build_app
from nanoserve.server.connection_limits import ConnectionLimits
from nanoserve.server.http_server import ServerThread

from support.server import SERVED, make_engine, pace, sse_payloads, wait_idle

HEADER_TIMEOUT_S = 1.25  # between two of the slow client's sends, which come every 0.5 s
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"


@contextmanager
def _served(demo_dir: Path, monkeypatch: pytest.MonkeyPatch, limits: ConnectionLimits) -> Iterator[str]:
    engine = make_engine(demo_dir)
    pace(engine, monkeypatch, 0.04)
    app = build_app(engine, ServerConfig(served_model_name=SERVED))
    with ServerThread(app, limits=limits) as server:
        server.wait_healthy(timeout=60)
        yield server.url
        wait_idle(app)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _drain(sock: socket.socket) -> bytes:
    """What the server sent on `sock` until it closed it (or reset it)."""
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def _response(sock: socket.socket) -> bytes:
    """One whole response (its head and a Content-Length body) read from `sock`."""
    sock.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < _content_length(got):
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return got


def _content_length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _closed_after(sock: socket.socket, start: float, limit: float) -> tuple[float, bytes]:
    """Seconds from `start` until the server closed `sock` (waiting at most `limit`), and what it sent."""
    sock.settimeout(limit)
    got = _drain(sock)
    return time.monotonic() - start, got


class _Stream(threading.Thread):
    """Another user's completion stream, with the time each of its chunks arrived."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.arrivals, self.raw, self.started = url, list[float](), b"", threading.Event()

    def run(self) -> None:
        body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                self.raw += chunk
                self.arrivals.append(time.monotonic())
                self.started.set()


def test_slowloris_connections_are_cut_at_the_header_deadline_while_another_client_streams(
        demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _served(demo_dir, monkeypatch, ConnectionLimits(header_timeout_s=HEADER_TIMEOUT_S)) as url:
        other = _Stream(url)
        other.start()
        assert other.started.wait(30)
        start = time.monotonic()
        slow = dict(enumerate(_connect(url) for _ in range(20)))
        silent = _connect(url)  # never sends a byte
        cut: dict[int, float] = {}
        answers: dict[int, bytes] = {}
        for i in range(len(SLOW_HEAD)):  # one byte every 0.5 s to every connection the server has not closed
            readable, _, _ = select.select(list(slow.values()), [], [], 0)
            for k, sock in list(slow.items()):
                if sock in readable:
                    cut[k], answers[k] = time.monotonic() - start, _drain(sock)
                    del slow[k]
                    continue
                try:
                    sock.sendall(SLOW_HEAD[i:i + 1])
                except OSError:
                    cut[k], answers[k] = time.monotonic() - start, _drain(sock)
                    del slow[k]
            if not slow or time.monotonic() - start > HEADER_TIMEOUT_S + 10:
                break
            time.sleep(0.5)
        assert not slow, f"{len(slow)} slowloris connections still open after {time.monotonic() - start:.1f} s"
        assert all(HEADER_TIMEOUT_S - 0.1 <= t < HEADER_TIMEOUT_S + 5 for t in cut.values()), cut
        sent = [a for a in answers.values() if a]  # one whose last byte crossed the close may read a reset
        assert len(sent) >= len(answers) - 2 and all(a.startswith(b"HTTP/1.1 408 ") for a in sent), answers
        took, got = _closed_after(silent, start, 10)
        assert got == b"" and HEADER_TIMEOUT_S - 0.1 <= took < HEADER_TIMEOUT_S + 5
        other.join(60)
        sse_payloads(other.raw)  # it ran to its end
        gaps = [b - a for a, b in zip(other.arrivals, other.arrivals[1:], strict=False)]
        assert len(other.arrivals) > 20 and max(gaps) < 1.0, max(gaps)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(demo_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole request is answered; the connection is then closed after the keep-alive timeout,
    and a connection that starts a second head after it is cut at the header deadline."""
    limits = ConnectionLimits(header_timeout_s=3.0, keep_alive_s=1)
    with _served(demo_dir, monkeypatch, limits) as url:
        sock = _connect(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        took, got = _closed_after(sock, time.monotonic(), 10)
        assert got == b"" and 0.9 <= took < 3.0, took
        sock = _connect(url)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # a second head begun, never finished
        took, got = _closed_after(sock, start, 10)
        assert got.startswith(b"HTTP/1.1 408 ") and 2.5 <= took < 6.0, (took, got)


def test_a_connection_past_the_cap_gets_a_503_and_the_open_ones_go_on(demo_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with _served(demo_dir, monkeypatch, ConnectionLimits(max_connections=2)) as url:
        other = _Stream(url)
        other.start()
        assert other.started.wait(30)
        idle = _connect(url)  # the second connection
        time.sleep(0.2)  # accepted by the server
        for path, shape in (("/v1/models", "openai"), ("/v1/messages", "anthropic")):
            r = httpx.get(f"{url}{path}", timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.headers["connection"] == "close"
            if shape == "openai":
                assert r.json()["error"]["code"] == "too_many_connections"
            else:
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        idle.close()
        deadline = time.monotonic() + 10
        while (r := httpx.get(f"{url}/v1/models", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.05)
        other.join(60)
        sse_payloads(other.raw)  # the stream that was open ran to its end
