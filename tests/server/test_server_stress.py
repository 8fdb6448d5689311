"""The server under stress: disconnects free their blocks, a flood meets a bounded queue (429),
the API key guards /v1/*, and SIGTERM / SIGINT shut the server down cleanly (exit 0)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nanoserve import cli
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server import ServerConfig, build_app
from nanoserve.server.http_server import ServerThread

from support.server import (
    SERVED,
    hold_after_first_output,
    hold_steps,
    make_engine,
    metric_value,
    pace,
    post_and_hang_up,
    serve,
    sse_payloads,
    wait_idle,
)

LONG = {"ignore_eos": True}
STREAM = {"model": SERVED, "prompt": "go on and on", "max_tokens": 100, "stream": True, **LONG}


@pytest.fixture(scope="module")
def engine(demo_dir: Path) -> LLMEngine:
    """At most two sequences run at once, so a third request waits."""
    return make_engine(demo_dir, max_num_seqs=2)


@pytest.fixture(autouse=True)
def paced(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-token request outlives the client's patience however fast the machine is."""
    pace(engine, monkeypatch)


def _aborted(url: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, 'nanoserve:request_finished_total{finished_reason="abort"}')


def _wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stream_disconnect_aborts_and_frees_every_block(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    release = hold_after_first_output(engine, monkeypatch)  # it cannot end before the client leaves
    with serve(engine) as (url, app):
        generated = engine.num_generated_tokens
        with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        wait_idle(app, timeout=30)  # the abort alone ends it: the engine takes no step meanwhile
        release.set()
        assert engine.num_generated_tokens - generated < 100  # it did not run to the end
        assert _aborted(url) == 1


def test_a_non_stream_disconnect_aborts_and_frees_every_block(engine: LLMEngine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    release = hold_after_first_output(engine, monkeypatch)  # it cannot end before the client gives up
    with serve(engine) as (url, app):
        generated = engine.num_generated_tokens
        post_and_hang_up(url, "/v1/completions", {**STREAM, "stream": False},
                         lambda: engine.num_generated_tokens > generated)  # once it runs (and waits, held)
        wait_idle(app, timeout=30)
        release.set()
        assert engine.num_generated_tokens - generated < 100
        assert _aborted(url) == 1


def test_a_waiting_request_that_disconnects_leaves_the_queue(engine: LLMEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def both_streaming() -> bool:  # the two that run stay mid-stream until the test is done
        running = engine.scheduler.running
        return len(running) == 2 and all(s.num_output_tokens for s in running)

    release = hold_steps(engine, monkeypatch, both_streaming)
    with serve(engine) as (url, app), contextlib.ExitStack() as streams:
        for _ in range(2):
            streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=60))
        _wait_for(lambda: app.state.engine.snapshot.num_running == 2)
        with httpx.stream("POST", f"{url}/v1/completions", json=STREAM, timeout=60):
            _wait_for(lambda: app.state.engine.snapshot.num_waiting == 1)
        _wait_for(lambda: app.state.engine.snapshot.num_waiting == 0)
        assert app.state.engine.snapshot.num_running == 2
        assert _aborted(url) == 1
        release.set()
        streams.close()
        wait_idle(app, timeout=10)


def test_a_flood_meets_a_bounded_queue_with_429(demo_dir: Path) -> None:
    # Streams long enough that the first two still run, however slowly the four are opened (they
    # are aborted when the test closes them).
    engine = make_engine(demo_dir, max_num_seqs=2, max_model_len=4096, num_kv_blocks=520)
    long_stream = {**STREAM, "max_tokens": 4000}
    with serve(engine, max_queued_requests=2) as (url, app), contextlib.ExitStack() as streams:
        for _ in range(4):  # two run, two wait: the queue is full
            streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=long_stream, timeout=60))
        _wait_for(lambda: (app.state.engine.snapshot.num_running, app.state.engine.snapshot.num_waiting) == (2, 2))
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full" and "max_queued_requests=2" in \
            error["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=SERVED, prompt="x", max_tokens=2)

        async def flood() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                rs = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                                            for _ in range(40)))
                return [x.status_code for x in rs]

        assert set(asyncio.run(flood())) == {429}
        assert app.state.engine.snapshot.num_waiting == 2  # never more than the bound
        streams.close()
        wait_idle(app, timeout=10)

        async def burst() -> list[int]:  # without the long streams, a burst partly gets through
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                rs = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, **LONG})
                                            for _ in range(20)))
                return [x.status_code for x in rs]

        codes = asyncio.run(burst())
        assert set(codes) <= {200, 429} and 200 in codes
        wait_idle(app, timeout=10)


def test_api_key(engine: LLMEngine) -> None:
    with serve(engine, api_key="s3cret") as (url, app):
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(f"{url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/tokenize", json={"prompt": "x"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        out = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.choices[0].message.content is not None
        wait_idle(app)


def test_health_is_503_while_the_model_loads(engine: LLMEngine) -> None:
    loaded = threading.Event()

    def slow_loader() -> LLMEngine:
        assert loaded.wait(timeout=30)
        return engine

    with ServerThread(build_app(slow_loader, ServerConfig(served_model_name=SERVED))) as server:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_loading"
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the model is still loading"
        loaded.set()
        server.wait_healthy(timeout=30)
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_serve_exits_1_when_the_model_does_not_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--log-level", "ERROR", "serve", str(tmp_path), "--port", str(_free_port())]
    assert cli.main(argv) == 1
    assert "loading the model failed" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, alive: Any) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert alive(), "the server exited"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def _stream_then_signal(url: str, send: Any) -> bytes:
    """Starts a long stream, sends the signal once it flows, and returns what the client got: the
    whole stream, or one cut by the shutdown, which ends with its error event and [DONE] all the same."""
    body = {**STREAM, "max_tokens": 120}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        chunks = r.iter_raw()
        received = [next(chunks)]
        send()
        received.extend(chunks)
    raw = b"".join(received)
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    last = sse_payloads(raw)[-1]
    if "error" in last:  # cut at the timeout
        assert last["error"]["message"] == "the server is shutting down"
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    return raw


SERVE_ARGS = ["--served-model-name", SERVED, "--num-kv-blocks", "32", "--max-model-len", "128",
              "--shutdown-timeout", "1"]


@pytest.mark.slow
def test_sigterm_shuts_the_process_down_within_the_timeout_and_exits_0(demo_dir: Path) -> None:
    """SIGTERM to the whole process group (as a service manager sends it): the engine-core process
    ignores it, so the stream in flight ends normally or at the shutdown timeout, never by a dead engine."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", str(demo_dir),
           "--port", str(port), *SERVE_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, lambda: proc.poll() is None)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "quick", "max_tokens": 2}).status_code == 200
        raw = _stream_then_signal(url, lambda: os.killpg(proc.pid, signal.SIGTERM))
        assert b"engine_dead" not in raw
        sent = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 15
        log = proc.stdout.read().decode()  # type: ignore[union-attr]
        assert "Traceback" not in log, log
        assert (": cut by the shutdown" in log) == (b'"error"' in raw), log  # one line per cut request
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigint_stops_nanoserve_serve_which_returns_0(demo_dir: Path) -> None:
    """In this process (SIGINT reaches the main thread, where the CLI runs uvicorn)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    got: list[bytes] = []
    serving = threading.Event()

    def client() -> None:
        try:
            _wait_healthy(url, lambda: True)
            got.append(_stream_then_signal(url, lambda: os.kill(os.getpid(), signal.SIGINT)))
        finally:
            if not got:
                os.kill(os.getpid(), signal.SIGINT)  # never leave the server running
            serving.set()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    assert cli.main(["--log-level", "WARNING", "serve", str(demo_dir), "--port", str(port), *SERVE_ARGS]) == 0
    assert serving.wait(timeout=30) and got
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
