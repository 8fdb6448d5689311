"""Tool calling end to end: a real server, the openai SDK, and a real checkpoint that calls a tool.

The checkpoint (`successor_model`) is a tiny Qwen3 that after the generation prompt writes
`<tool_call>`, one JSON call in three tokens (so its arguments arrive over two steps), then
`</tool_call>` and `<|im_end|>` (tokens added to the demo tokenizer). Its chat template is Qwen's
format: tools listed in the system turn, calls between <tool_call> tags, results in
<tool_response> tags.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tokenizers
import torch
from fastapi import FastAPI

from nanoserve.tokenizer import Tokenizer

from support.server import SERVED, make_engine, serve, sse_payloads, wait_idle
from support.successor_model import set_successors, successor_checkpoint
from support.tool_calls import CALL, CALL_PIECES, CALL_TEXT, TOOLS

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tool_model(make_checkpoint: Callable[..., Path], demo_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    pieces = ["<tool_call>", *CALL_PIECES, "</tool_call>"]
    path = successor_checkpoint(make_checkpoint, demo_dir, tmp_path_factory.mktemp("tool-model") / "m", TEMPLATE,
                                [tokenizers.AddedToken(t, normalized=False) for t in pieces])
    tok = Tokenizer.from_pretrained_dir(path)
    after_prompt = tok.encode_chat(MESSAGES)[-1]  # "assistant\n" in context
    set_successors(path, [[after_prompt, *(tok.backend.token_to_id(t) for t in [*pieces, "<|im_end|>"])]])
    return path


@pytest.fixture(scope="module")
def server(tool_model: Path) -> Iterator[tuple[str, FastAPI]]:
    with serve(make_engine(tool_model, max_model_len=512, num_kv_blocks=128)) as served:
        yield served


@pytest.fixture
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    wait_idle(server[1])


def test_the_model_writes_the_call(client: openai.OpenAI) -> None:
    """Without tools the output is the raw text: the checkpoint really generates the call."""
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
    assert r.choices[0].message.content == f"<tool_call>{CALL_TEXT}</tool_call>"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.usage is not None and r.usage.completion_tokens == 6  # the call's five tokens and <|im_end|>


def test_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0, n=2)  # type: ignore[arg-type]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    """As OpenAI streams a call: a first chunk with the id, type, name and empty arguments, then
    the arguments text as it is generated, in chunks of the same index; joined, they equal the
    non-streamed call's arguments."""
    whole = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0)  # type: ignore[arg-type]
    (expected,) = whole.choices[0].message.tool_calls or []
    stream = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0,  # type: ignore[arg-type]
                                            stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    first, *rest = calls
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function and first.function.name == "get_weather" and first.function.arguments == ""
    # The arguments come as the tokens do ('{"city": ', then '"Paris"}'), or merged into fewer
    # chunks when this client reads more slowly than the engine steps: never an empty one.
    pieces = [c.function.arguments for c in rest if c.function]
    assert pieces and all(pieces)
    assert all(c.index == 0 and c.id is None and c.function and c.function.name is None for c in rest)
    assert "".join(c.function.arguments or "" for c in calls if c.function) == expected.function.arguments
    assert json.loads(expected.function.arguments) == CALL["arguments"]


def test_streamed_calls_of_many_choices(server: tuple[str, FastAPI]) -> None:
    """n = 3, sampled: each choice's deltas join to one call of its own, with its own id."""
    body = {"messages": MESSAGES, "tools": TOOLS, "n": 3, "stream": True, "temperature": 0.5, "seed": 1}
    payloads = sse_payloads(httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=60).content)
    arguments: dict[int, str] = {0: "", 1: "", 2: ""}
    ids: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for p in payloads:
        for choice in p["choices"]:
            for call in choice["delta"].get("tool_calls", []):
                assert call["index"] == 0
                arguments[choice["index"]] += call["function"]["arguments"]
                ids[choice["index"]] += [call["id"]] if "id" in call else []
    assert all(json.loads(a) == CALL["arguments"] for a in arguments.values())
    assert all(len(i) == 1 for i in ids.values()) and len({i[0] for i in ids.values()}) == 3


def test_tool_choice_none_renders_no_tools(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    url = server[0]
    with_tools = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["count"]
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                       temperature=0.0)
    assert r.choices[0].message.content == f"<tool_call>{CALL_TEXT}</tool_call>"
    assert r.usage is not None and r.usage.prompt_tokens == with_tools  # the tools were not rendered
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens > with_tools


def test_conversation_with_a_tool_result(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    """The assistant's call comes back with arguments as JSON text (as the SDK sends them) and is
    rendered once-encoded; the tool's answer follows."""
    history: list[Any] = [*MESSAGES,
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "call_1", "type": "function",
                               "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    ids = httpx.post(f"{server[0]}/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(f"{server[0]}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f"<tool_call>{CALL_TEXT}</tool_call>" in text and "<tool_response>sunny, 21 C</tool_response>" in text
    r = client.chat.completions.create(model=SERVED, messages=history, tools=TOOLS, temperature=0.0)
    assert r.choices[0].finish_reason == "tool_calls"


BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call(client: openai.OpenAI, choice: Any, stream: bool) -> None:
    """tool_choice "required" or a named function forces a call through the grammar: whatever
    the model would write, the message is calls to the allowed functions with valid arguments;
    with parallel_tool_calls false, exactly one."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    allowed = set(schemas) if choice == "required" else {"get_time"}
    for seed in range(2):
        kwargs: Any = dict(model=SERVED, messages=MESSAGES, tools=BOUNDED_TOOLS, tool_choice=choice, seed=seed,
                           temperature=1.0, parallel_tool_calls=False, max_tokens=100)
        if stream:
            calls: dict[int, Any] = {}
            finish = None
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                for c in chunk.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
                    entry["name"] += (c.function and c.function.name) or ""
                    entry["arguments"] += (c.function and c.function.arguments) or ""
                finish = chunk.choices[0].finish_reason or finish
            made = list(calls.values())
        else:
            r = client.chat.completions.create(**kwargs)
            finish = r.choices[0].finish_reason
            made = [{"name": c.function.name, "arguments": c.function.arguments}
                    for c in r.choices[0].message.tool_calls or []]
        assert finish == "tool_calls" and len(made) == 1
        assert made[0]["name"] in allowed
        jsonschema.validate(json.loads(made[0]["arguments"]), schemas[made[0]["name"]])


# A second call, written as one added token (every token of the chain has one successor, so the
# second call cannot reuse the first one's tokens).
SECOND_CALL = {"name": "get_time", "arguments": {"zone": "UTC"}}
SECOND_CALL_TOKEN = f"\n<tool_call>{json.dumps(SECOND_CALL)}</tool_call>"


@pytest.fixture(scope="module")
def two_calls_url(make_checkpoint: Callable[..., Path], demo_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A checkpoint that writes two calls, then `<|im_end|>`."""
    pieces = ["<tool_call>", *CALL_PIECES, "</tool_call>", SECOND_CALL_TOKEN]
    path = successor_checkpoint(make_checkpoint, demo_dir, tmp_path_factory.mktemp("two-calls") / "m", TEMPLATE,
                                [tokenizers.AddedToken(t, normalized=False) for t in pieces])
    tok = Tokenizer.from_pretrained_dir(path)
    after_prompt = tok.encode_chat(MESSAGES)[-1]
    set_successors(path, [[after_prompt, *(tok.backend.token_to_id(t) for t in [*pieces, "<|im_end|>"])]])
    with serve(make_engine(path, max_model_len=512, num_kv_blocks=128)) as (url, app):
        yield url
        wait_idle(app)


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_with_tool_choice_auto(two_calls_url: str, parallel: bool | None, stream: bool) -> None:
    """The model writes two calls: both are returned unless parallel_tool_calls is false, which
    keeps the first (the second is neither a call nor content: the content stays empty); either way
    the choice ends "tool_calls"."""
    client = openai.OpenAI(base_url=f"{two_calls_url}/v1", api_key="unused", max_retries=0)
    kwargs: Any = dict(model=SERVED, messages=MESSAGES, tools=BOUNDED_TOOLS, temperature=0.0)
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    if stream:
        calls: dict[int, Any] = {}
        content, finish = "", None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"name": "", "arguments": ""})
                entry["name"] += (c.function and c.function.name) or ""
                entry["arguments"] += (c.function and c.function.arguments) or ""
            finish = chunk.choices[0].finish_reason or finish
        made = [calls[i] for i in sorted(calls)]
    else:
        r = client.chat.completions.create(**kwargs)
        finish, content = r.choices[0].finish_reason, r.choices[0].message.content or ""
        made = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in r.choices[0].message.tool_calls or []]
    expected = [CALL] if parallel is False else [CALL, SECOND_CALL]
    assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in made] == expected
    assert finish == "tool_calls" and content == ""


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
])
def test_bad_tool_fields(server: tuple[str, FastAPI], body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server[0]}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)


def test_model_without_a_tool_format(demo_dir: Path) -> None:
    """The demo template shows no tool format: tools get a 400 that says what to do."""
    with serve(make_engine(demo_dir)) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200


def test_tokens_decode_to_text(tool_model: Path) -> None:
    """The successor map is what the fixture says: checked once without the server."""
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(tool_model), dtype=torch.float32, max_model_len=128)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert out.text == f"<tool_call>{CALL_TEXT}</tool_call>" and out.finish_reason == "stop"


MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}"
    "{%- endfor %}<|im_end|>{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_SPECIAL = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                   "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def mistral_server(make_checkpoint: Callable[..., Path], demo_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A checkpoint in Mistral's v11 format: after `[/INST]` it writes
    `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, the markers being special tokens."""
    words = ["get_weather", '{"city": ', '"Paris"}']
    added = [tokenizers.AddedToken(t, normalized=False, special=True) for t in MISTRAL_SPECIAL]
    path = successor_checkpoint(make_checkpoint, demo_dir, tmp_path_factory.mktemp("mistral-model") / "m",
                                MISTRAL_TEMPLATE, added + [tokenizers.AddedToken(w, normalized=False) for w in words])
    tok = Tokenizer.from_pretrained_dir(path)
    chain = ["[/INST]", "[TOOL_CALLS]", "get_weather", "[ARGS]", *words[1:], "<|im_end|>"]
    set_successors(path, [[tok.backend.token_to_id(t) for t in chain]])
    with serve(make_engine(path, max_model_len=512, num_kv_blocks=128)) as (url, app):
        yield url
        wait_idle(app)


def test_mistral_tool_call(mistral_server: str) -> None:
    """`[TOOL_CALLS]` is a special token: with tools the text keeps it (the parser needs it),
    without them it is skipped as usual. Streamed deltas join to the non-streamed call."""
    client = openai.OpenAI(base_url=f"{mistral_server}/v1", api_key="unused", max_retries=0)
    plain = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
    assert plain.choices[0].message.content == 'get_weather{"city": "Paris"}'
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0)  # type: ignore[arg-type]
    (call,) = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    stream = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0,  # type: ignore[arg-type]
                                            stream=True)
    calls = [c for chunk in stream for c in chunk.choices[0].delta.tool_calls or []]
    assert calls[0].function and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert "".join(c.function.arguments or "" for c in calls if c.function) == call.function.arguments
