"""Forced tool calls on a model whose chat template shows no tool-call format (the demo model):
tool_choice "required" or a named function makes the reply a JSON array of calls through the
grammar, returned as `tool_calls`, streamed and not; "auto" still needs a parser (a 400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI

from nanoserve.engine.llm_engine import LLMEngine

from support.server import SERVED, serve, wait_idle

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    with serve(engine) as served:
        yield served


@pytest.fixture
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    wait_idle(server[1])


def _streamed(client: openai.OpenAI, kwargs: dict[str, Any]) -> tuple[list[dict[str, str]], str | None, str]:
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
            if c.id is not None:
                assert not entry["name"] and c.function is not None and c.function.name  # a call's first chunk
            entry["name"] += (c.function and c.function.name) or ""
            entry["arguments"] += (c.function and c.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def _reply(client: openai.OpenAI, kwargs: dict[str, Any], stream: bool) -> tuple[list[dict[str, str]], str | None, str]:
    if stream:
        return _streamed(client, kwargs)
    r = client.chat.completions.create(**kwargs)
    message = r.choices[0].message
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls or [])
    made = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    return made, r.choices[0].finish_reason, message.content or ""


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_one_forced_call_validates(client: openai.OpenAI, choice: Any, stream: bool) -> None:
    """With parallel_tool_calls false, whatever the demo model would write, each reply is one call
    to an allowed function whose arguments validate against its parameters."""
    allowed = set(SCHEMAS) if choice == "required" else {"get_time"}
    for seed in range(3):
        made, finish, content = _reply(client, dict(
            model=SERVED, messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=seed, temperature=1.0,
            max_tokens=100, parallel_tool_calls=False), stream)
        assert finish == "tool_calls" and content == "" and len(made) == 1
        assert made[0]["name"] in allowed
        jsonschema.validate(json.loads(made[0]["arguments"]), SCHEMAS[made[0]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_forced_calls_validate(client: openai.OpenAI, stream: bool) -> None:
    """With parallel calls allowed the array takes one or more calls: every call the reply
    completed validates; only the last may be cut short, when the reply ran out of tokens (the
    demo model keeps adding calls)."""
    for seed in range(2):
        made, finish, _ = _reply(client, dict(model=SERVED, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              seed=seed, temperature=1.0, max_tokens=100), stream)
        assert finish in ("tool_calls", "length") and len(made) >= 2
        complete = made if finish == "tool_calls" else made[:-1]
        for call in complete:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [False, True])
def test_stream_and_whole_reply_agree(client: openai.OpenAI, parallel: bool) -> None:
    kwargs: dict[str, Any] = dict(model=SERVED, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                  temperature=0.0, max_tokens=100, parallel_tool_calls=parallel)
    whole = _reply(client, kwargs, stream=False)
    assert whole == _reply(client, kwargs, stream=True)
    assert whole[1] == "tool_calls" or parallel


def test_auto_still_needs_a_parser(server: tuple[str, FastAPI]) -> None:
    url, app = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"})
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    wait_idle(app)
