"""The OpenAI-compatible server end to end: a real server on a loopback port driven by the openai
SDK (sync and async, streaming and not) and by raw httpx for the SSE bytes."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from nanoserve import LLM, SamplingParams, cli
from nanoserve.commands.chat import chat_loop
from nanoserve.engine.llm_engine import LLMEngine

from support.server import (
    ENGINE_ARGS,
    SERVED,
    gate_steps,
    hold_after_first_output,
    metric_value,
    sse_payloads,
    wait_idle,
)

GREEDY: dict[str, Any] = {"temperature": 0.0}
LONG = {"ignore_eos": True}  # the demo model's random weights may emit EOS at any point


@pytest.fixture
def url(server: tuple[str, FastAPI]) -> Iterator[str]:
    """The base URL; after each test the KV pool must be fully free again."""
    yield server[0]
    wait_idle(server[1])


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_health_and_models(url: str, client: openai.OpenAI) -> None:
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == [SERVED]
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_completion_matches_offline_llm(url: str, client: openai.OpenAI, demo_dir: Path) -> None:
    prompt = "The quick brown fox"
    offline = LLM(str(demo_dir), **ENGINE_ARGS).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    out = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12, extra_body=LONG, **GREEDY)
    assert out.object == "text_completion" and out.model == SERVED and out.id.startswith("cmpl-")
    assert out.choices[0].text == offline.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == len(offline.outputs[0].token_ids) == 12
    assert out.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    full = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=10, extra_body=LONG, **GREEDY)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=SERVED, messages=messages, max_completion_tokens=10,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=LONG, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    usage, first = chunks[-1].usage, full.usage
    assert first is not None and (usage.prompt_tokens, usage.completion_tokens) == (first.prompt_tokens, 10)
    assert usage.prompt_tokens_details.cached_tokens == 16  # type: ignore[union-attr]  # one full block, reused
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_framing(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    release = hold_after_first_output(engine, monkeypatch)
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
            "stream": True, "stream_options": {"include_usage": True}, **LONG, **GREEDY}
    reads: list[bytes] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = r.iter_raw()
            reads.append(next(chunks))  # while the engine waits after its first output: the rest is not made yet
            release.set()
            reads.extend(chunks)
    finally:
        release.set()
    assert len(reads) >= 2 and b"[DONE]" not in reads[0]  # events reach the client as they are generated
    payloads = sse_payloads(b"".join(reads))
    assert len({p["id"] for p in payloads}) == 1
    assert all(p["object"] == "chat.completion.chunk" and p["model"] == SERVED for p in payloads)
    for index in (0, 1):
        mine = [p["choices"][0] for p in payloads if p["choices"] and p["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert mine[-1] == {"index": index, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 12


def test_stop_string_is_held_back_and_cut(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    text = client.completions.create(model=SERVED, prompt=prompt, max_tokens=16, extra_body=LONG,
                                     **GREEDY).choices[0].text
    stop = text[6:10]
    assert stop.strip(), text
    chunks = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=16, stop=[stop], stream=True,
                                            extra_body=LONG, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_stream_has_a_chunk_per_step_even_without_text(url: str, engine: LLMEngine) -> None:
    """A step whose token has no text yet (here a special token, skipped in the text) still streams
    a chunk, as vLLM and llama-server do, so a client sees the first token when it is made; the
    finishing step's chunk is the finish chunk."""
    tok = engine.tokenizer
    assert tok is not None
    added = tok.backend.get_added_tokens_decoder()
    silent = next(i for i in sorted(added) if tok.is_special(i) and i not in tok.stop_token_ids)
    assert tok.decode([silent]) == ""
    body = {"model": SERVED, "prompt": "Once upon", "max_tokens": 5, "stream": True, "logit_bias": {silent: 100},
            **LONG, **GREEDY}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200
    choices = [p["choices"][0] for p in sse_payloads(r.content) if p.get("choices")]
    assert [c["text"] for c in choices] == [""] * 5
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]


def test_prompts_n_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=SERVED, prompt=["one", "two three"], n=2, max_tokens=4, logprobs=2,
                                    seed=7, extra_body=LONG)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == 4
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs or [])
        assert c.logprobs.text_offset == sorted(c.logprobs.text_offset or [])
    assert out.usage is not None and out.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, extra_body=LONG, **GREEDY)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == content[0].logprob  # greedy picks the top token


def test_token_ids_prompt_and_echo(client: openai.OpenAI, url: str) -> None:
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}
    by_text = client.completions.create(model=SERVED, prompt="hello world", max_tokens=4, extra_body=LONG, **GREEDY)
    by_ids = client.completions.create(model=SERVED, prompt=ids, max_tokens=4, echo=True, extra_body=LONG, **GREEDY)
    assert by_ids.choices[0].text == "hello world" + by_text.choices[0].text
    chat_ids = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_ids["count"] == len(chat_ids["tokens"]) > 2 and chat_ids["max_model_len"] == 128


def test_stream_text_with_unicode_line_separators_reads_line_by_line(url: str) -> None:
    """U+2028, U+2029 and U+0085 in streamed text (here an echoed prompt; a model can as well emit
    them) go out escaped: httpx's iter_lines, which many Python SSE clients read with, splits on them,
    and a raw one cut an event in two (a JSONDecodeError in the client; seen in `bench serve`)."""
    prompt = "a\u2028b\u2029c\x85d"
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 3, "echo": True, "stream": True, **LONG, **GREEDY}
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(prompt)


def test_every_sdk_field_and_nulls(client: openai.OpenAI, url: str) -> None:
    out = client.chat.completions.create(
        model=SERVED, messages=[{"role": "developer", "content": "Terse."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=5, temperature=0.8, top_p=0.9, n=2, stop=["zzzz"], seed=3, presence_penalty=0.5,
        frequency_penalty=0.5, user="me", metadata={"k": "v"}, store=False, stream=False,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2},
    )
    assert len(out.choices) == 2 and out.usage is not None and out.usage.completion_tokens == 10
    nulls = {"model": None, "prompt": "a", "max_tokens": None, "temperature": None, "stop": None, "n": None,
             "seed": None, "stream": None, "stream_options": None, "logprobs": None, "some_new_field": None}
    r = httpx.post(f"{url}/v1/completions", json=nulls)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16
    r = httpx.post(f"{url}/v1/completions", json={**nulls, "brand_new_field": 1})  # never silently ignored
    assert r.status_code == 400 and r.json()["error"]["param"] == "brand_new_field", r.text


def test_async_streams_share_one_batch(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    gate_steps(engine, monkeypatch, lambda: len(engine.scheduler.waiting) + len(engine.scheduler.running) >= 8)
    widest = [0]
    step = engine.step

    def recording_step() -> Any:
        widest[0] = max(widest[0], len(engine.scheduler.running))
        return step()

    monkeypatch.setattr(engine, "step", recording_step)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        messages: Any = [{"role": "user", "content": f"story number {i}"}]
        stream = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12, stream=True,
                                                      extra_body=LONG, **GREEDY)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        full = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12,
                                                    extra_body=LONG, **GREEDY)
        return text, full.choices[0].message.content or ""

    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(main())
    assert all(streamed == whole for streamed, whole in results)
    assert widest[0] == 8  # the streams ran together in one batch


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt about the weather in the mountains and the sea. " * 3
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, extra_body=LONG)
    second = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, extra_body=LONG)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # type: ignore[union-attr]
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens  # type: ignore[union-attr]


def test_metrics(url: str, client: openai.OpenAI) -> None:
    client.completions.create(model=SERVED, prompt="metrics", max_tokens=3, extra_body=LONG)
    r = httpx.get(f"{url}/metrics", follow_redirects=False)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert metric_value(text, f"nanoserve:{name}") >= 0
    assert metric_value(text, 'nanoserve:request_finished_total{finished_reason="length"}') >= 1
    assert metric_value(text, "nanoserve:generation_tokens_total") >= 3
    assert metric_value(text, "nanoserve:time_to_first_token_seconds_count") >= 1
    assert "nanoserve:moe_" not in text  # a dense model has no expert series


class _Terminal(io.StringIO):
    """Captures chat output; raises KeyboardInterrupt at the first reply text if `interrupt`."""

    def __init__(self, interrupt: bool) -> None:
        super().__init__()
        self.interrupt = interrupt
        self.replying = False

    def write(self, s: str) -> int:
        if self.interrupt and self.replying and s:
            self.interrupt = False
            raise KeyboardInterrupt
        return super().write(s)


def _turns(*lines: str) -> Any:
    """A `read` for chat_loop that answers the lines, then Ctrl-D."""
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_chat_command_keeps_history_and_stops_on_ctrl_c(url: str) -> None:
    ns = argparse.Namespace(system="Be nice.", max_tokens=20, temperature=0.0)
    term = _Terminal(interrupt=True)
    sent: list[list[dict[str, Any]]] = []

    def record(request: httpx.Request) -> None:
        term.replying = True
        sent.append(json.loads(request.content)["messages"])

    with httpx.Client(base_url=url, timeout=60, event_hooks={"request": [record]}) as http:
        assert chat_loop(http, SERVED, ns, read=_turns("Hello", "Tell me more", "/clear", "Again"), out=term) == 0
    assert "[stopped]" in term.getvalue()  # the first reply was interrupted at its first text
    assert [[m["role"] for m in msgs] for msgs in sent] == [
        ["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert sent[1][3]["content"] == "Tell me more"


def test_chat_command_reports_errors(url: str) -> None:
    ns = argparse.Namespace(system=None, max_tokens=100_000, temperature=0.0)
    term = _Terminal(interrupt=False)
    with httpx.Client(base_url=url, timeout=60) as http:
        assert chat_loop(http, SERVED, ns, read=_turns("Hello"), out=term) == 0
    assert "[error 400: this model's maximum context length is 128 tokens" in term.getvalue()


def test_health_answers_while_busy(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine loop runs on its own thread: the event loop answers /health while the engine's
    thread computes in Python (here it spins, after its first output, until /health has answered)."""
    answered = threading.Event()
    spun_until_answered: list[bool] = []
    produced = False
    step = engine.step

    def busy_step() -> Any:
        nonlocal produced
        if produced and not spun_until_answered:
            deadline = time.monotonic() + 60
            while not answered.is_set() and time.monotonic() < deadline:
                sum(range(1000))  # holds the interpreter lock but for its switch interval
            spun_until_answered.append(answered.is_set())
        out = step()
        produced = produced or bool(out.deltas)
        return out

    monkeypatch.setattr(engine, "step", busy_step)
    body = {"model": SERVED, "prompt": "busy", "max_tokens": 4, "stream": True, **LONG}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)  # the first output is out: the engine's thread spins now
            assert httpx.get(f"{url}/health", timeout=60).status_code == 200
            answered.set()
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        answered.set()
    assert spun_until_answered == [True]


def test_nanoserve_chat_command(url: str, demo_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """`nanoserve chat --url URL` and `nanoserve chat MODEL` (which serves MODEL in-process)."""
    flags = ["--max-tokens", "4", "--temperature", "0", "--num-kv-blocks", "16", "--max-model-len", "64"]
    for argv in (["chat", "--url", url], ["chat", str(demo_dir)]):
        monkeypatch.setattr("builtins.input", _turns("Hi"))
        assert cli.main(["--log-level", "WARNING", *argv, *flags]) == 0
        out = capsys.readouterr().out
        assert out.startswith("Chatting with ") and "error" not in out
    assert cli.main(["chat", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot use the server at http://127.0.0.1:9" in capsys.readouterr().err
