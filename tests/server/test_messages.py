"""The Anthropic Messages API end to end: a real server on a loopback port, the `anthropic` SDK (and
httpx for the raw wire), and a real checkpoint that thinks and calls a tool.

The checkpoint (`successor_model`) is a tiny Qwen3 with a Qwen3-style chat template that renders
tools, assistant tool calls and tool results, and writes an empty think block into the generation
prompt with `enable_thinking: false`. After the plain generation prompt it writes `<think>`, one
reasoning token, `</think>`, then a tool call (in three tokens, so its arguments arrive over two
steps) and `<|im_end|>`; after the prompt with the empty block it answers in one token. The
reasoning parser (qwen3) and the tool-call parser (hermes) are read from the template. The server
has an API key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
import tokenizers
import transformers
from fastapi import FastAPI

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server.chat.output import ChoiceDelta
from nanoserve.server.chat.tool_parsers.calls import ToolCallDelta
from nanoserve.server.protocol.anthropic import CountTokensRequest
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.serving_messages import ContentBlocks
from nanoserve.tokenizer import Tokenizer

from support.server import (
    SERVED,
    hold_after_first_output,
    make_engine,
    metric_value,
    post_and_hang_up,
    serve,
    wait_idle,
)
from support.successor_model import set_successors, successor_checkpoint
from support.tool_calls import CALL, CALL_PIECES, CALL_TEXT

KEY = "sk-messages-test"
REASONING = "The user asks about the weather in Paris."
ANSWER = "It is sunny in Paris."
USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                  "description": t["description"]}} for t in TOOLS]
TEMPLATE = (  # Qwen3's shape: literal strings, so no newline is lost to whitespace control
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}"
    "{{- '</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>' + m.content + '</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' }}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{- '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def model_path(make_checkpoint: Callable[..., Path], demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = ["<think>", "</think>", "\n\n", REASONING, ANSWER, "<tool_call>", *CALL_PIECES, "</tool_call>"]
    path = successor_checkpoint(make_checkpoint, demo_dir, tmp_path_factory.mktemp("messages-model") / "m", TEMPLATE,
                                [tokenizers.AddedToken(w, normalized=False) for w in words])
    tok = Tokenizer.from_pretrained_dir(path)
    thinking = tok.encode_chat([USER])[-1]
    direct = tok.encode_chat([USER], enable_thinking=False)[-1]
    assert thinking != direct == tok.backend.token_to_id("\n\n")
    chain = ["<think>", REASONING, "</think>", "<tool_call>", *CALL_PIECES, "</tool_call>", "<|im_end|>"]
    ids = [tok.backend.token_to_id(w) for w in chain]
    set_successors(path, [[thinking, *ids], [direct, tok.backend.token_to_id(ANSWER), ids[-1]]])
    return path


@pytest.fixture(scope="module")
def engine(model_path: Path) -> LLMEngine:
    return make_engine(model_path, max_model_len=512, num_kv_blocks=128)


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    with serve(engine, api_key=KEY) as served:
        yield served


@pytest.fixture
def client(server: tuple[str, FastAPI]) -> Iterator[anthropic.Anthropic]:
    yield anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)
    wait_idle(server[1])


def reference_count(path: Path, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    """The prompt's token count as transformers renders and tokenizes it (the reference)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)
    return len(ids["input_ids"])


def test_thinking_and_a_tool_call(client: anthropic.Anthropic) -> None:
    r = client.messages.create(model=SERVED, max_tokens=64, messages=[USER], tools=TOOLS,
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0.0})
    thinking, call = r.content
    assert thinking.type == "thinking" and thinking.thinking == REASONING
    assert call.type == "tool_use" and call.name == CALL["name"] and call.input == CALL["arguments"]
    assert call.id.startswith("toolu_") and r.id.startswith("msg_")
    assert r.stop_reason == "tool_use" and r.stop_sequence is None and r.role == "assistant" and r.model == SERVED
    assert r.usage.output_tokens == 9  # <think>, reasoning, </think>, the call's five tokens, <|im_end|>


def test_tool_round_trip(client: anthropic.Anthropic, model_path: Path) -> None:
    """The call goes back as the assistant's tool_use, its result as the user's tool_result; the
    prompt they render is exactly transformers' rendering of the same chat (counted both ways),
    and the model answers it."""
    first = client.messages.create(model=SERVED, max_tokens=64, messages=[USER], tools=TOOLS,
                                   extra_body={"temperature": 0.0})
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    history: list[Any] = [USER, {"role": "assistant", "content": first.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "sunny, 21 C"}]}]
    counted = client.messages.count_tokens(model=SERVED, messages=history, tools=TOOLS, thinking=NO_THINKING)
    reference = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": CALL["name"], "arguments": CALL["arguments"]}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    assert counted.input_tokens == reference_count(model_path, reference, tools=OPENAI_TOOLS, enable_thinking=False)
    rendered = transformers.AutoTokenizer.from_pretrained(model_path).apply_chat_template(
        reference, tools=OPENAI_TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert f"<tool_call>{CALL_TEXT}</tool_call>" in rendered
    assert "<tool_response>sunny, 21 C</tool_response>" in rendered
    second = client.messages.create(model=SERVED, max_tokens=64, messages=history, tools=TOOLS,
                                    thinking=NO_THINKING, extra_body={"temperature": 0.0})
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", ANSWER)]
    assert second.stop_reason == "end_turn" and second.usage.input_tokens == counted.input_tokens


def test_count_tokens(client: anthropic.Anthropic, model_path: Path) -> None:
    """Equal to transformers' count of the same prompt, with and without tools, system and thinking."""
    system = "You are terse."
    plain = client.messages.count_tokens(model=SERVED, messages=[USER])
    assert plain.input_tokens == reference_count(model_path, [USER])
    blocks = client.messages.count_tokens(model=SERVED, messages=[{"role": "user", "content": [
        {"type": "text", "text": USER["content"], "cache_control": {"type": "ephemeral"}}]}])
    assert blocks.input_tokens == plain.input_tokens
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": CALL["arguments"]}
    failed = client.messages.count_tokens(model=SERVED, messages=[
        USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "is_error": True, "content": [{"type": "text", "text": "no"}]},
            {"type": "text", "text": "Try again."}]}])
    assert failed.input_tokens == reference_count(model_path, [
        USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": CALL["arguments"]}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no"}, {"role": "user", "content": "Try again."}])
    full = client.messages.count_tokens(model=SERVED, messages=[USER], system=system, tools=TOOLS,
                                        thinking=NO_THINKING)
    expected = reference_count(model_path, [{"role": "system", "content": system}, USER], tools=OPENAI_TOOLS,
                               enable_thinking=False)
    assert full.input_tokens == expected > plain.input_tokens
    r = client.messages.create(model=SERVED, max_tokens=8, messages=[USER], system=system, tools=TOOLS,
                               thinking=NO_THINKING)
    assert r.usage.input_tokens == full.input_tokens


def events_of(client: anthropic.Anthropic, **kwargs: Any) -> tuple[list[Any], Any]:
    with client.messages.stream(model=SERVED, messages=[USER], extra_body={"temperature": 0.0}, **kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def test_stream_with_thinking_and_a_call(client: anthropic.Anthropic) -> None:
    """Anthropic's event sequence: message_start; a thinking block, then a tool_use block whose
    arguments come as input_json_delta pieces; message_delta; message_stop. The streamed message
    equals the non-streamed one."""
    events, final = events_of(client, max_tokens=64, tools=TOOLS)
    raw = [e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                           "content_block_stop", "message_delta", "message_stop")]
    kinds = [(e.type, getattr(e, "index", None)) for e in raw]
    first_json = next(i for i, e in enumerate(raw) if e.type == "content_block_delta" and e.index == 1)
    assert kinds[:3] == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0)]
    assert kinds[3:first_json] == [("content_block_stop", 0), ("content_block_start", 1)]
    assert all(k == ("content_block_delta", 1) for k in kinds[first_json:-3])
    assert kinds[-3:] == [("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert raw[0].message.usage.input_tokens > 0 and raw[0].message.content == []
    assert raw[1].content_block.type == "thinking" and raw[2].delta.type == "thinking_delta"
    start = raw[first_json - 1].content_block
    assert start.type == "tool_use" and start.name == CALL["name"] and start.input == {}
    pieces = [e.delta.partial_json for e in raw[first_json:-3]]
    assert all(e.delta.type == "input_json_delta" for e in raw[first_json:-3]) and all(pieces)
    assert json.loads("".join(pieces)) == CALL["arguments"]
    assert raw[-2].delta.stop_reason == "tool_use" and raw[-2].usage.output_tokens == 9
    whole = client.messages.create(model=SERVED, max_tokens=64, messages=[USER], tools=TOOLS,
                                   extra_body={"temperature": 0.0})
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stream_text_equals_the_greedy_message(client: anthropic.Anthropic) -> None:
    events, final = events_of(client, max_tokens=16, thinking=NO_THINKING)
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]
    whole = client.messages.create(model=SERVED, max_tokens=16, messages=[USER], thinking=NO_THINKING,
                                   extra_body={"temperature": 0.0})
    assert "".join(texts) == ANSWER == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert not any(e.type == "content_block_start" and e.content_block.type == "thinking" for e in events)


def test_max_tokens(client: anthropic.Anthropic) -> None:
    """Cut inside the think block: all of it is thinking, and the reason says why it ended."""
    r = client.messages.create(model=SERVED, max_tokens=2, messages=[USER], extra_body={"temperature": 0.0})
    assert [b.type for b in r.content] == ["thinking"] and r.content[0].thinking == REASONING
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client: anthropic.Anthropic, stream: bool) -> None:
    """The reply ends before the first stop sequence it writes, which `stop_sequence` names."""
    kwargs: Any = dict(model=SERVED, max_tokens=16, messages=[USER], thinking=NO_THINKING,
                       stop_sequences=["never", "sunny", "sun"], extra_body={"temperature": 0.0})
    if stream:
        events, r = events_of(client, **{k: v for k, v in kwargs.items()
                                         if k not in ("model", "messages", "extra_body")})
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "It is "
    else:
        r = client.messages.create(**kwargs)
    assert r.content[0].text == "It is " and r.stop_reason == "stop_sequence" and r.stop_sequence == "sunny"


def test_tool_choice(client: anthropic.Anthropic, server: tuple[str, FastAPI]) -> None:
    """`none` renders no tools (the prompt is the tool-less one); `tool` forces a call to the
    named tool whatever the model would write (sampled here)."""
    plain = client.messages.count_tokens(model=SERVED, messages=[USER], thinking=NO_THINKING).input_tokens
    r = client.messages.create(model=SERVED, max_tokens=8, messages=[USER], tools=TOOLS,
                               tool_choice={"type": "none"}, thinking=NO_THINKING)
    assert r.usage.input_tokens == plain and r.content[0].text == ANSWER
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        r = client.messages.create(model=SERVED, max_tokens=64, messages=[USER], tools=TOOLS,
                                   tool_choice=choice, thinking=NO_THINKING,
                                   extra_body={"temperature": 1.0, "top_k": 50, "top_p": 0.9})
        calls = [b for b in r.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
        assert r.stop_reason == "tool_use"


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [NO_THINKING, {"type": "enabled", "budget_tokens": 1024}])
def test_output_format(client: anthropic.Anthropic, thinking: Any) -> None:
    """`output_config.format` constrains the answer (after the think block, which stays
    thinking) to the schema, whatever the model would write (sampled here)."""
    output_config = {"format": {"type": "json_schema", "schema": SCHEMA}}
    for _ in range(2):
        r = client.messages.create(model=SERVED, max_tokens=64, messages=[USER], thinking=thinking,
                                   output_config=output_config, extra_body={"temperature": 1.0})
        *thought, answer = r.content
        assert [b.type for b in thought] == (["thinking"] if thinking["type"] == "enabled" else [])
        assert answer.type == "text" and r.stop_reason == "end_turn"
        jsonschema.validate(json.loads(answer.text), SCHEMA)


def test_api_key(server: tuple[str, FastAPI]) -> None:
    """`x-api-key` is taken as well as the bearer token; without either, a 401 in Anthropic's
    shape here and in OpenAI's on the OpenAI routes."""
    url = server[0]
    body = {"model": SERVED, "messages": [USER]}
    r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": r.json()["error"]["message"]}}
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{url}/v1/models").json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=SERVED, messages=[USER])


GOOD: dict[str, Any] = {"model": SERVED, "max_tokens": 8, "messages": [USER]}


@pytest.mark.parametrize(("change", "status", "words"), [
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "tool_use"),
    ({"messages": [USER, {"role": "assistant", "content": "It is"}]}, 400, "prefilled"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, 400, "name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time"}}, 400, "get_time"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0"),
    ({"thinking": {"type": "between_tools"}}, 400, "thinking"),
    ({"stop_sequences": [""]}, 400, "stop_sequences"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": -1.0}, 400, "temperature"),
    ({"container": "c-1"}, 400, "container"),
    ({"tools": [{**TOOLS[0], "strict": True}]}, 400, "tools.0.strict: unsupported field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{}]}]}]},
     400, "messages.0.content.0.citations: unsupported field"),
    ({"output_config": {"effort": "high"}}, 400, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, 400, "nonsense"),
    ({"model": "claude-opus"}, 404, "claude-opus"),
])
def test_bad_bodies(server: tuple[str, FastAPI], change: dict[str, Any], status: int, words: str) -> None:
    """Each is refused before it runs, in Anthropic's error shape, and the server stays healthy
    with every KV block free."""
    url, app = server
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == status, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    assert words in error["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(app)


def test_bad_json_and_methods(server: tuple[str, FastAPI], client: anthropic.Anthropic) -> None:
    url = server[0]
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{url}/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=SERVED, max_tokens=8, messages=[USER], stop_sequences=[""])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=[USER])


def test_an_engine_failure_mid_stream_is_an_error_event(server: tuple[str, FastAPI], engine: LLMEngine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails after the stream began ends it with Anthropic's `error` event; the server
    stays up and frees every block."""
    url, app = server
    step, armed = engine.step, [True]

    def flaky_step() -> Any:
        if armed[0] and any(r.num_output_tokens >= 1 for r in engine.scheduler.running):
            armed[0] = False
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(engine, "step", flaky_step)
    body = {**GOOD, "max_tokens": 64, "stream": True, "temperature": 0.0}
    raw = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60).text
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    assert frames[0][0] == "event: message_start" and frames[-1][0] == "event: error"
    error = json.loads(frames[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "injected step failure" in error["error"]["message"]
    assert not any(f[0] == "event: message_stop" for f in frames)
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(app)
    r = httpx.post(f"{url}/v1/messages", json={**body, "stream": False}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn"  # no tools: the call is text
    assert r.json()["content"][-1] == {"type": "text", "text": f"<tool_call>{CALL_TEXT}</tool_call>"}


@pytest.mark.parametrize(("thinking", "reads", "thinks", "expected"), [
    (None, True, True, {}),
    ({"type": "adaptive"}, True, True, {}),
    ({"type": "enabled", "budget_tokens": 1024}, True, True, {"enable_thinking": True}),
    ({"type": "disabled"}, True, True, {"enable_thinking": False}),
    ({"type": "enabled", "budget_tokens": 1024}, False, False, {}),
    ({"type": "disabled"}, False, False, {}),
    ({"type": "disabled"}, False, True, None),  # a model that always thinks: cannot be switched off
])
def test_thinking_maps_onto_the_template(thinking: Any, reads: bool, thinks: bool, expected: Any) -> None:
    body = CountTokensRequest.model_validate({"model": SERVED, "messages": [USER], "thinking": thinking})
    if expected is None:
        with pytest.raises(APIError) as caught:
            body.thinking_kwargs(reads, thinks)
        assert caught.value.status == 400 and caught.value.param == "thinking"
    else:
        assert body.thinking_kwargs(reads, thinks) == expected


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request(server: tuple[str, FastAPI], engine: LLMEngine,
                                                 monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """The engine holds after the reply's first token, so the client leaves (after the first event,
    or once the request runs) before the reply could end; the request is aborted and its blocks
    freed with no further step."""
    url, app = server
    release = hold_after_first_output(engine, monkeypatch)
    before, generated = aborted(url), engine.num_generated_tokens
    body = {**GOOD, "max_tokens": 64, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
            assert next(r.iter_lines()) == "event: message_start"
    else:
        post_and_hang_up(url, "/v1/messages", body, lambda: engine.num_generated_tokens > generated,
                         headers={"x-api-key": KEY})
    wait_idle(app, timeout=30)
    release.set()
    assert aborted(url) == before + 1


def aborted(url: str) -> float:
    """The count of aborted requests (0 before the first: the labelled sample appears with it)."""
    metrics = httpx.get(f"{url}/metrics").text
    try:
        return metric_value(metrics, 'nanoserve:request_finished_total{finished_reason="abort"}')
    except AssertionError:  # no such sample yet
        return 0.0


def test_blocks_follow_the_order_of_the_text() -> None:
    """A delta that ends an open call and then writes text: the call's arguments go to its block
    before the text opens one; text before a new call comes before it."""
    blocks = ContentBlocks()
    events = blocks.add(ChoiceDelta("", "", [ToolCallDelta(0, "get_weather"), ToolCallDelta(0, None, '{"city": ')]))
    events += blocks.add(ChoiceDelta("", "Done. Now:", [ToolCallDelta(0, None, '"Paris"}'), ToolCallDelta(1, "f")]))
    events += blocks.close()
    assert [(b["type"], b.get("text"), b.get("input")) for b in blocks.blocks] == [
        ("tool_use", None, {"city": "Paris"}), ("text", "Done. Now:", None), ("tool_use", None, {})]
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_stop", 2)]
