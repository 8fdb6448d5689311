"""The engine core: its message protocol driven directly (Ready, one Update per iteration, Exited;
stream-interval merging; refused requests; a failed step), and the core in a process of its own
behind a real server (same greedy output as the in-thread core, validation in the front end,
disconnects free blocks, a killed engine process fails the streams and the health check), and a
speculative core process (the shipped demo draft) serving the plain greedy output and reporting
its drafts in /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.demo import demo_draft_path
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    EngineInfo,
    EngineState,
    Exited,
    Message,
    Ready,
    Update,
    run_core,
)
from nanoserve.server import ServerConfig, build_app
from nanoserve.server.http_server import ServerThread

from support.server import ENGINE_ARGS, SERVED, make_engine, metric_value, serve, sse_payloads, wait_idle

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _drive(engine: LLMEngine, script: list[list[Command]]) -> list[Message]:
    """Runs the core on this thread: `receive` hands out the scripted batches of commands one per
    iteration, then nothing while requests are unfinished, then a stop. Returns every message."""
    sent: list[Message] = []

    def receive(timeout: float | None) -> list[Command]:
        if script:
            return script.pop(0)
        return [None] if timeout is None else []

    run_core(lambda: engine, receive, sent.append)
    return sent


def _tokens(messages: list[Message], rid: str) -> list[int]:
    return [t for m in messages if isinstance(m, Update) for d in m.deltas if d.request_id == rid for t in d.token_ids]


def _reference(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("reference", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens.extend(t for d in engine.step().deltas for t in d.token_ids)
    return tokens


def test_ready_then_one_update_per_iteration_then_exited(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Once upon a time")
    expected = _reference(engine, prompt, GREEDY)
    messages = _drive(engine, [[AddRequest("a", prompt, GREEDY, 0)]])
    ready, *updates, exited = messages
    assert isinstance(ready, Ready) and ready.info.limits == engine.limits
    assert ready.info.tokenizer is engine.tokenizer
    assert exited == Exited(EngineState.STOPPED)
    assert all(isinstance(u, Update) for u in updates) and len(updates) == len(expected)
    assert updates[0].applied_adds == 1 and updates[0].scheduled == ["a"]
    assert all(u.applied_adds == 0 and not u.scheduled for u in updates[1:])
    assert _tokens(messages, "a") == expected
    assert updates[-1].deltas[-1].finish_reason == "length"
    assert [u.finished for u in updates] == [[]] * (len(updates) - 1) + [["a"]]  # the end, reported once
    assert updates[-1].snapshot.num_running == 0 and updates[-1].snapshot.kv.blocks_used == 0


def test_stream_interval_merges_steps_but_never_delays_the_first_or_the_last(engine: LLMEngine) -> None:
    """The core sends every step's deltas; the front end's stream hands its consumer (which keeps
    up) five steps' worth merged, but the first token and the end at once."""
    prompt = engine.tokenizer.encode("The weather today")
    expected = _reference(engine, prompt, GREEDY)

    async def run() -> tuple[list[Message], list[list[SequenceDelta]]]:
        front = AsyncEngine(lambda: engine, stream_interval=5)  # never started: the core's messages go in by hand
        front._on_message(Ready(EngineInfo(engine.tokenizer, engine.limits), engine.snapshot()))
        stream = front.add([prompt], GREEDY)
        messages = _drive(engine, [front._receive(0.0)])
        got: list[list[SequenceDelta]] = []

        async def consume() -> None:
            async for deltas in stream:
                got.append(deltas)

        consumer = asyncio.ensure_future(consume())
        for message in messages[1:]:
            front._on_message(message)
            for _ in range(3):  # the consumer takes whatever is due before the next message
                await asyncio.sleep(0)
        await consumer
        return messages, got

    messages, got = asyncio.run(run())
    assert len([d for m in messages if isinstance(m, Update) for d in m.deltas]) == len(expected)  # one per step
    assert [[len(d.token_ids) for d in deltas] for deltas in got] == [[1], [5], [5], [1]]  # first, 2 intervals, end
    assert [t for deltas in got for d in deltas for t in d.token_ids] == expected and got[-1][-1].finished


def test_a_refused_request_fails_alone(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Hello")
    bad = [engine.limits.vocab_size + 5]
    messages = _drive(engine, [[AddRequest("bad", bad, GREEDY, 0), AddRequest("good", prompt, GREEDY, 0)]])
    first = messages[1]
    assert isinstance(first, Update) and first.applied_adds == 2
    assert list(first.failed) == ["bad"] and first.failed["bad"].startswith("the engine refused the request")
    assert len(_tokens(messages, "good")) == GREEDY.max_tokens and not _tokens(messages, "bad")


def test_an_abort_ends_a_request_between_steps(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode("Tell me a story")
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    messages = _drive(engine, [[AddRequest("a", prompt, long, 0)], [], [AbortRequest("a")]])
    assert len(_tokens(messages, "a")) == 2  # two steps ran before the abort
    assert not any(m.finished for m in messages if isinstance(m, Update))  # an abort is the caller's own news
    last = messages[-2]
    assert isinstance(last, Update) and last.snapshot.num_running == 0 and last.snapshot.kv.blocks_used == 0


def test_a_failed_step_fails_the_requests_in_flight_and_the_core_goes_on(
        engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    step = engine.step
    calls = 0

    def failing_once() -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return step()

    monkeypatch.setattr(engine, "step", failing_once)
    prompt = engine.tokenizer.encode("Hi")
    messages = _drive(engine, [[AddRequest("a", prompt, GREEDY, 0), AddRequest("b", prompt, GREEDY, 0)],
                               [], [AddRequest("c", prompt, GREEDY, 0)]])
    failed = messages[2]
    assert isinstance(failed, Update)
    assert failed.failed == {"a": "the engine failed: RuntimeError: boom", "b": "the engine failed: RuntimeError: boom"}
    assert failed.snapshot.kv.blocks_used == 0
    assert len(_tokens(messages, "c")) == GREEDY.max_tokens and messages[-1] == Exited(EngineState.STOPPED)


def test_an_engine_left_broken_by_a_failed_step_exits_dead(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken)
    monkeypatch.setattr(engine, "abort", lambda rid: False)  # the failed requests stay in the engine
    prompt = engine.tokenizer.encode("Hi")
    messages = _drive(engine, [[AddRequest("a", prompt, GREEDY, 0)]])
    exited = messages[-1]
    assert isinstance(exited, Exited) and exited.state is EngineState.DEAD
    assert "still holds requests or blocks" in (exited.error or "")
    monkeypatch.undo()
    engine.abort("a")
    assert not engine.has_unfinished() and engine.kv_stats().blocks_used == 0


def test_a_loader_that_raises_exits_dead_without_ready() -> None:
    def loader() -> LLMEngine:
        raise OSError("no such checkpoint")

    sent: list[Message] = []
    run_core(loader, lambda block: [None], sent.append)
    assert sent == [Exited(EngineState.DEAD, "no such checkpoint")]


# --- the core in its own process, behind a real server -----------------------------------------------------------


@contextlib.contextmanager
def _process_server(demo_dir: Path, config: dict[str, Any] | None = None, on_fatal: Callable[[], None] | None = None,
                    **args: Any) -> Iterator[tuple[str, Any]]:
    engine_args = EngineArgs(model=str(demo_dir), **{**ENGINE_ARGS, **args})
    app = build_app(engine_args, ServerConfig(served_model_name=SERVED, **(config or {})), on_fatal=on_fatal)
    with ServerThread(app) as server:
        server.wait_healthy(timeout=120)
        yield server.url, app


def _core_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name == "nanoserve-engine-core"]


PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "What is your name?"]


async def _greedy_outputs(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def complete(prompt: str) -> str:
        out = await client.completions.create(model=SERVED, prompt=prompt, max_tokens=16, temperature=0)
        return out.choices[0].text

    async def chat(prompt: str) -> str:
        stream = await client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=16, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    return list(await asyncio.gather(*(complete(p) for p in PROMPTS), *(chat(p) for p in PROMPTS)))


@pytest.mark.slow
def test_a_core_process_serves_what_the_in_thread_core_serves(demo_dir: Path) -> None:
    with serve(make_engine(demo_dir)) as (url, app):
        expected = asyncio.run(_greedy_outputs(url))
        wait_idle(app)
    with _process_server(demo_dir) as (url, app):
        assert len(_core_processes()) == 1
        assert asyncio.run(_greedy_outputs(url)) == expected
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == ENGINE_ARGS["max_model_len"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi " * 200, "max_tokens": 4})
        assert r.status_code == 400 and "maximum context length is 128" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": "go on", "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # then close the connection mid-stream
        wait_idle(app)
    deadline = time.monotonic() + 30
    while _core_processes():  # the app's shutdown stopped the process
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_speculative_core_process_serves_the_plain_greedy_output_and_counts_its_drafts(demo_dir: Path) -> None:
    """`nanoserve serve --speculative-model` as the CLI runs it (the core in its own process, the
    shipped distilled draft): concurrent greedy completions and streamed chats, plus a request with
    logprobs (which never speculates) in the same batches, come out as the plain in-thread server's;
    /metrics counts the drafts, and its acceptance rate and mean accepted length are those counts'."""
    logprobs_body = {"model": SERVED, "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0,
                     "ignore_eos": True, "logprobs": 2}

    async def outputs(url: str) -> tuple[list[str], Any]:
        async with httpx.AsyncClient(timeout=120) as client:
            texts, with_logprobs = await asyncio.gather(
                _greedy_outputs(url), client.post(f"{url}/v1/completions", json=logprobs_body))
        assert with_logprobs.status_code == 200, with_logprobs.text
        return texts, with_logprobs.json()["choices"][0]

    with serve(make_engine(demo_dir)) as (url, app):
        expected_texts, expected_choice = asyncio.run(outputs(url))
        wait_idle(app)
    draft = demo_draft_path(demo_dir.parent)
    with _process_server(demo_dir, speculative_model=str(draft), num_speculative_tokens=4) as (url, app):
        texts, choice = asyncio.run(outputs(url))
        assert texts == expected_texts
        assert choice["text"] == expected_choice["text"]
        assert choice["logprobs"]["tokens"] == expected_choice["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected_choice["logprobs"]["token_logprobs"],
                                                                     abs=1e-4)
        wait_idle(app)
        page = httpx.get(f"{url}/metrics").text
        proposed = metric_value(page, "nanoserve:spec_decode_num_draft_tokens_total")
        accepted = metric_value(page, "nanoserve:spec_decode_num_accepted_tokens_total")
        verifications = metric_value(page, "nanoserve:spec_decode_num_verifications_total")
        assert 0 < accepted <= proposed <= 4 * verifications
        assert metric_value(page, "nanoserve:spec_decode_acceptance_rate") == pytest.approx(accepted / proposed)
        assert metric_value(page, "nanoserve:spec_decode_mean_accepted_length") == pytest.approx(
            (accepted + verifications) / verifications)


@pytest.mark.slow
def test_a_killed_core_process_fails_its_streams_and_the_health_check(demo_dir: Path) -> None:
    with _process_server(demo_dir, {"engine_restarts": 0}, max_model_len=2048, num_kv_blocks=256) as (url, _):
        body = {"model": SERVED, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            chunks = r.iter_raw()
            received = [next(chunks)]
            (core,) = _core_processes()
            assert core.pid is not None
            os.kill(core.pid, signal.SIGKILL)
            received.extend(chunks)
        payloads = sse_payloads(b"".join(received))
        errors = [p for p in payloads if "error" in p]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unavailable"
        assert "exited with code -9" in errors[0]["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503


def _kill_core() -> None:
    (core,) = _core_processes()
    assert core.pid is not None
    os.kill(core.pid, signal.SIGKILL)


def _wait_for_health(url: str, code: int, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{url}/health", timeout=10)).status_code != code:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.05)
    return health


@pytest.mark.slow
def test_a_killed_core_process_is_restarted_until_its_restarts_run_out(demo_dir: Path) -> None:
    """Killed once: in-flight streams fail, /health says the engine is dead and being restarted,
    then a new core serves (counted in the metrics). Killed past `engine_restarts`: on_fatal."""
    fatal: list[bool] = []
    with _process_server(demo_dir, {"engine_restarts": 1}, on_fatal=lambda: fatal.append(True),
                         max_model_len=2048, num_kv_blocks=256) as (url, app):
        body = {"model": SERVED, "prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            chunks = r.iter_raw()
            received = [next(chunks)]
            _kill_core()
            received.extend(chunks)
        assert [p["error"]["code"] for p in sse_payloads(b"".join(received)) if "error" in p] == ["engine_unavailable"]
        health = httpx.get(f"{url}/health", timeout=10)  # dead until the restart's delay has passed, then loading
        assert health.status_code == 503 and health.json()["error"]["code"] in ("engine_dead", "engine_loading")
        _wait_for_health(url, 200)
        r = httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert app.state.engine.num_restarts == 1 and not fatal
        assert metric_value(httpx.get(f"{url}/metrics").text, "nanoserve:engine_restarts_total") == 1
        _kill_core()
        deadline = time.monotonic() + 60
        while not fatal:
            assert time.monotonic() < deadline, "on_fatal was not called"
            time.sleep(0.05)
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert app.state.engine.num_restarts == 1


@pytest.mark.slow
def test_a_core_process_that_cannot_load_marks_the_engine_dead(tmp_path: Path) -> None:
    failed: list[bool] = []
    app = build_app(EngineArgs(model=str(tmp_path)), ServerConfig(served_model_name=SERVED),
                    on_fatal=lambda: failed.append(True))
    with ServerThread(app) as server:
        deadline = time.monotonic() + 120
        while (health := httpx.get(f"{server.url}/health")).json()["error"]["code"] == "engine_loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert str(tmp_path) in health.json()["error"]["message"] and failed == [True]
