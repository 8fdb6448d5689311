"""Bad input and failures: each is answered in OpenAI's error shape, before any stream starts when
the input is bad, and touches no other request; the engine survives what it can survive."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import nanoserve.server.serving_chat
from nanoserve.engine.llm_engine import LLMEngine

from support.server import SERVED, make_engine, pace, serve, sse_payloads, wait_idle

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG = {"ignore_eos": True}

# (path, body, param, words the message must contain)
BAD_BODIES: list[tuple[str, dict[str, Any], str | None, str]] = [
    (CHAT, {"messages": []}, "messages", "at least 1"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, "temperature", "valid number"),
    (CHAT, {"messages": MSG, "temperature": 3}, "temperature", "[0, 2], got 3"),
    (CHAT, {"messages": MSG, "top_p": 0}, "top_p", "(0, 1]"),
    (CHAT, {"messages": MSG, "n": 0}, "n", "greater than or equal to 1"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens", "at least 1"),
    (CHAT, {"messages": MSG, "max_tokens": 500}, "messages", "maximum context length is 128 tokens"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "valid string"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'user'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "only text"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, "logprobs", "[0, 20], got 50"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 101.0}}, "logit_bias", "[-100, 100]"),
    (CHAT, {"messages": MSG, "logit_bias": {"x5": 1.0}}, "logit_bias", "must be token ids, got 'x5'"),
    (CHAT, {"messages": MSG, "logit_bias": {"999999": 1.0}}, "logit_bias", "token ids must be in [0, "),
    (CHAT, {"messages": MSG, "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [5, 999999]}, "allowed_token_ids", "must be in [0, "),
    (CHAT, {"messages": MSG, "bad_words": [""]}, "bad_words", "non-empty strings"),
    (CHAT, {"messages": MSG, "frobnicate": 1, "zeta": 2}, "frobnicate", "unsupported request fields: frobnicate, zeta"),
    (CHAT, {"messages": MSG, "prompt_logprobs": 1}, "prompt_logprobs", "unsupported request field: prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "service_tier": "auto"}, "service_tier", "unsupported request field"),
    (CHAT, {"messages": MSG, "store": True}, "store", "stores no completions"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "with streaming"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20], got 21"),
    ("/tokenize", {"prompt": "x", "extra": True}, "extra", "unsupported request field"),
    (CHAT, {"messages": MSG, "seed": 2**70}, "seed", "less than"),
    (CHAT, {"messages": MSG, "stop": [""]}, "stop", "non-empty"),
    (CHAT, {"messages": MSG, "stream": "yes"}, "stream", "valid boolean"),
    (CHAT, {"messages": MSG, "max_tokens": 10, "min_tokens": 50}, "min_tokens", "got 50"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "boolean"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "empty"),
    (COMPLETIONS, {"prompt": []}, "prompt", "empty"),
    (COMPLETIONS, {}, "prompt", "Field required"),
    (COMPLETIONS, {"prompt": [999999]}, "prompt", "must be in [0, "),
    (COMPLETIONS, {"prompt": [5] * 120, "max_tokens": 20}, "prompt", "140 (120 in the prompt + 20 max_tokens)"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 1.5}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1}, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "must be in"),
]


@pytest.fixture
def url(server: tuple[str, FastAPI], engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The base URL, with paced steps so that each failure meets requests in flight; after each
    test the KV pool must be fully free again."""
    pace(engine, monkeypatch)
    yield server[0]
    wait_idle(server[1])


def _assert_error(r: httpx.Response, status: int, param: str | None = None, words: str = "") -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


def test_bad_inputs_are_400_while_a_stream_runs_untouched(url: str) -> None:
    body = {"model": SERVED, "prompt": "steady", "max_tokens": 60, "stream": True,
            "stream_options": {"include_usage": True}, **LONG}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=120) as running, httpx.Client() as http:
        chunks = running.iter_raw()
        received = [next(chunks)]
        for path, bad, param, words in BAD_BODIES:
            _assert_error(http.post(f"{url}{path}", json=bad), 400, param, words)
            if path in (CHAT, COMPLETIONS) and "stream" not in bad:  # refused before any stream starts
                _assert_error(http.post(f"{url}{path}", json={**bad, "stream": True}), 400, param, words)
        for raw in (b"{not json", b"[1, 2]", b""):
            _assert_error(http.post(f"{url}{CHAT}", content=raw), 400)
        _assert_error(http.get(f"{url}/v1/nope"), 404, None, "no route GET /v1/nope")
        for path, body in ((CHAT, {"messages": MSG}), (COMPLETIONS, {"prompt": "x"}), ("/tokenize", {"prompt": "x"})):
            unknown = http.post(f"{url}{path}", json={**body, "model": "gpt-9"})
            _assert_error(unknown, 404, "model", "`gpt-9` does not exist")
        _assert_error(http.get(f"{url}{CHAT}"), 405)
        received.extend(chunks)
    payloads = sse_payloads(b"".join(received))
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
    assert payloads[-1]["usage"]["completion_tokens"] == 60


def test_a_failed_step_fails_the_requests_in_flight_and_the_engine_recovers(
        url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    step, armed = engine.step, [True]

    def flaky_step() -> Any:
        running = engine.scheduler.running
        if armed[0] and len(running) == 2 and min(r.num_output_tokens for r in running) >= 2:
            armed[0] = False
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(engine, "step", flaky_step)
    body = {"model": SERVED, "prompt": "doomed", "max_tokens": 80, **LONG}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", f"{url}{COMPLETIONS}", json={**body, "stream": True},
                                                     timeout=120) as streamed:
        plain = pool.submit(httpx.post, f"{url}{COMPLETIONS}", json=body, timeout=120)
        payloads = sse_payloads(streamed.read())
        error = _assert_error(plain.result(), 500, None, "injected step failure")
    assert error["code"] == "engine_error"
    assert payloads[-1]["error"]["message"] == error["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}{COMPLETIONS}", json={**body, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_failing_add_fails_only_that_request(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    add = engine.add_request

    def picky_add(request_id: str, prompt_ids: list[int], *args: Any, **kwargs: Any) -> None:
        if prompt_ids == [7, 7, 7]:
            raise RuntimeError("injected add failure")
        add(request_id, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", picky_add)
    body = {"model": SERVED, "prompt": "fine", "max_tokens": 20, "stream": True, **LONG}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=120) as running:
        chunks = running.iter_raw()
        received = [next(chunks)]
        r = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": [7, 7, 7], "max_tokens": 5})
        _assert_error(r, 500, None, "injected add failure")
        received.extend(chunks)
    payloads = sse_payloads(b"".join(received))
    assert [p["choices"][0]["finish_reason"] for p in payloads][-1] == "length"


def test_an_exception_in_one_handler_fails_only_that_request(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("injected formatting failure")

    monkeypatch.setattr(nanoserve.server.serving_chat, "chat_logprobs", broken)
    body = {"model": SERVED, "messages": MSG, "max_tokens": 20, "stream": True, **LONG}
    with httpx.stream("POST", f"{url}{CHAT}", json=body, timeout=120) as healthy:
        chunks = healthy.iter_raw()
        received = [next(chunks)]
        failed = httpx.post(f"{url}{CHAT}", json={**body, "logprobs": True}, timeout=120)
        assert failed.status_code == 200  # the stream had started: the error comes as an event
        events = sse_payloads(failed.content)
        assert events[-1]["error"]["message"] == "internal server error: RuntimeError"
        _assert_error(httpx.post(f"{url}{CHAT}", json={**body, "stream": False, "logprobs": True}, timeout=120),
                      500, None, "internal server error")
        received.extend(chunks)
    payloads = sse_payloads(b"".join(received))
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(p["choices"][0]["delta"].get("content", "") for p in payloads)) > 0


def test_a_broken_engine_is_dead_and_health_says_so(demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(demo_dir)

    def fail(*args: Any) -> Any:
        raise RuntimeError("injected corruption")

    with serve(engine) as (url, _):
        monkeypatch.setattr(engine, "step", fail)
        monkeypatch.setattr(engine, "abort", fail)
        body = {"model": SERVED, "messages": MSG, "max_tokens": 5, "stream": True}
        r = httpx.post(f"{url}{CHAT}", json=body)
        assert r.status_code == 200
        assert "injected corruption" in sse_payloads(r.content)[-1]["error"]["message"]
        error = _assert_error(httpx.get(f"{url}/health"), 503, None, "injected corruption")
        assert error["code"] == "engine_dead"
        error = _assert_error(httpx.post(f"{url}{CHAT}", json=body), 503, None, "stopped after an error")
        assert error["code"] == "engine_unavailable"
        assert json.loads(httpx.get(f"{url}/v1/models").text)["data"][0]["id"] == SERVED
