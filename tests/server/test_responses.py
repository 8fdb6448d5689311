"""POST /v1/responses end to end: a real server on loopback, the openai SDK (and httpx for raw bodies).

The checkpoint (`successor_model`) is a tiny Qwen3 whose next token depends on the current one
only. Its chat template is Qwen3-shaped (tools in the system turn, calls in <tool_call> tags,
results in <tool_response> tags, past reasoning in think tags, `enable_thinking: false` writing an
empty think block), and it marks the end of the generation prompt so that such a model can tell
three situations apart: a plain prompt ends in "assistant\\n" (the model thinks: `<think>`, one
reasoning token, `</think>`, then the answer), a prompt with tools ends in `<use_tools>` (the model
calls get_weather), and a prompt whose last message is a tool result ends in `<result>` (the model
answers). The reasoning parser (qwen3) and the tool-call parser (hermes) are read from the template.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import tokenizers
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.server import ServerConfig
from nanoserve.server.response_store import ResponseStore, StoredResponse
from nanoserve.tokenizer import Tokenizer

from support.server import SERVED, hold_after_first_output, make_engine, metric_value, serve, wait_idle
from support.successor_model import set_successors, successor_checkpoint
from support.tool_calls import CALL, CALL_PIECES

QUESTION = "What is the weather in Paris?"
REASONING = "The user asks about the weather in Paris."
ANSWER = "It is sunny in Paris."
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}"
    "{{- '</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>' + m.content + '</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>' }}"
    "{{- {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{{- '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if messages[-1].role == 'tool' %}{{- '<result>' }}"
    "{%- elif tools %}{{- '<use_tools>' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- endif %}{%- endif %}"
)
STORE_SIZE = 3


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path], demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = ["<think>", "</think>", "\n\n", REASONING, ANSWER, "<use_tools>", "<result>", "<tool_call>", *CALL_PIECES,
             "</tool_call>"]
    path = successor_checkpoint(make_checkpoint, demo_dir, tmp_path_factory.mktemp("responses-model") / "m", TEMPLATE,
                                [tokenizers.AddedToken(w, normalized=False) for w in words])
    tok = Tokenizer.from_pretrained_dir(path)
    ids = {w: tok.backend.token_to_id(w) for w in [*words, "<|im_end|>"]}
    thinking = tok.encode_chat([{"role": "user", "content": QUESTION}])[-1]
    assert thinking not in ids.values()
    set_successors(path, [
        [thinking, *(ids[w] for w in ["<think>", REASONING, "</think>", "\n\n", ANSWER, "<|im_end|>"])],
        [ids["<use_tools>"], *(ids[w] for w in ["<tool_call>", *CALL_PIECES, "</tool_call>", "<|im_end|>"])],
        [ids["<result>"], ids[ANSWER]],
    ])
    return path


@pytest.fixture(scope="module")
def model_engine(model: Path) -> LLMEngine:
    return make_engine(model, max_model_len=512, num_kv_blocks=128)


@pytest.fixture(scope="module")
def server(model_engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    with serve(model_engine, responses_store_size=STORE_SIZE) as served:
        yield served


@pytest.fixture
def client(server: tuple[str, FastAPI]) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    wait_idle(server[1])


def prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    return int(httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["count"])


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    """Output items with their generated ids left out (they differ from response to response)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in items]


def test_text_with_reasoning(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    r = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == [REASONING]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.output_text == ANSWER
    assert r.usage is not None
    assert r.usage.input_tokens == prompt_tokens(server[0], [{"role": "user", "content": QUESTION}])
    assert r.usage.output_tokens == 6  # <think>, the reasoning, </think>, "\n\n", the answer, <|im_end|>
    assert r.usage.output_tokens_details.reasoning_tokens == 1
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.incomplete_details is None and r.store is False


def event_shape(events: list[Any]) -> list[str]:
    """Event types, runs of the same delta type counted once (a slow reader gets merged deltas)."""
    shape: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and shape and shape[-1] == e.type):
            shape.append(e.type)
    return shape


def test_stream_events(client: openai.OpenAI) -> None:
    """The SDK parses every event into its typed model; the sequence is OpenAI's, numbered from
    0, and its items and text equal the non-streamed response's."""
    whole = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0)
    events = list(client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert event_shape(events) == [
        "response.created", "response.in_progress",
        *item, "response.reasoning_text.delta", "response.reasoning_text.done", *done,
        *item, "response.output_text.delta", "response.output_text.done", *done,
        "response.completed"]
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (reasoning, text) == (REASONING, whole.output_text) and final.output_text == text
    assert without_ids(final.output) == without_ids(whole.output)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "message")]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.item_id == final.output[1].id and e.output_index == 1 and e.content_index == 0 for e in deltas)
    assert final.usage == whole.usage


def test_the_sdks_stream_accumulator(client: openai.OpenAI) -> None:
    """`client.responses.stream` rebuilds the response from the events, checking that each one
    refers to an item and content part already added; its result equals the non-streamed one,
    tool calls included."""
    for tools in ([], [TOOL]):
        whole = client.responses.create(model=SERVED, input=QUESTION, tools=tools, temperature=0.0)  # type: ignore[arg-type]
        with client.responses.stream(model=SERVED, input=QUESTION, tools=tools, temperature=0.0) as stream:  # type: ignore[arg-type]
            final = stream.get_final_response()
        assert without_ids(final.output) == without_ids(whole.output) and final.output_text == whole.output_text


def test_parse_into_a_pydantic_model(client: openai.OpenAI) -> None:
    """`client.responses.parse(text_format=Model)` sends the model's strict JSON schema as
    text.format and parses the reply into it."""
    from pydantic import BaseModel

    class Weather(BaseModel):
        weather: Literal["sunny", "rainy"]

    r = client.responses.parse(model=SERVED, input=QUESTION, text_format=Weather, temperature=0.0)
    assert isinstance(r.output_parsed, Weather)


def test_instructions_and_reasoning_effort(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    """`instructions` are the system turn; effort "none" closes the think block in the prompt
    (Qwen3's enable_thinking), so the model answers at once; "high" leaves thinking on."""
    r = client.responses.create(model=SERVED, input=QUESTION, instructions="Answer briefly.", temperature=0.0)
    assert r.usage is not None and r.instructions == "Answer briefly."
    assert r.usage.input_tokens == prompt_tokens(server[0], [{"role": "system", "content": "Answer briefly."},
                                                             {"role": "user", "content": QUESTION}])
    off = client.responses.create(model=SERVED, input=QUESTION, reasoning={"effort": "none"}, temperature=0.0)
    assert [item.type for item in off.output] == ["message"] and off.output_text == ANSWER
    on = client.responses.create(model=SERVED, input=QUESTION, reasoning={"effort": "high"}, temperature=0.0)
    assert [item.type for item in on.output] == ["reasoning", "message"] and on.output_text == ANSWER
    assert off.usage is not None and on.usage is not None
    assert off.usage.input_tokens == on.usage.input_tokens + 4  # "<think>", "\n\n", "</think>", "\n\n"


def test_incomplete_at_max_output_tokens(client: openai.OpenAI) -> None:
    r = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in r.output] == [("reasoning", "incomplete")]
    assert r.usage is not None and r.usage.output_tokens == 2
    events = list(client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, max_output_tokens=2,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_tool_round_trip(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    """The call comes out as a function_call item (streamed as argument deltas); sent back with
    its output, the conversation renders as the chat equivalent and the model answers."""
    r = client.responses.create(model=SERVED, input=QUESTION, tools=[TOOL], temperature=0.0)  # type: ignore[list-item]
    (call,) = r.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == CALL["arguments"]
    events = list(client.responses.create(model=SERVED, input=QUESTION, tools=[TOOL], temperature=0.0,  # type: ignore[list-item]
                                          stream=True))
    assert event_shape(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments == events[-2].item.arguments  # type: ignore[union-attr]

    followup: list[Any] = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
                           {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model=SERVED, input=followup, tools=[TOOL], temperature=0.0)  # type: ignore[list-item]
    assert answer.output_text == ANSWER and [item.type for item in answer.output] == ["message"]
    chat = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    with_tools = httpx.post(f"{server[0]}/tokenize", json={"messages": chat}).json()["count"]
    assert answer.usage is not None and answer.usage.input_tokens > with_tools  # the tools are rendered too


def test_tool_choice(client: openai.OpenAI) -> None:
    """"none" renders no tools (so this model thinks and answers); "required" and a named
    function force the call through a grammar, which here agrees with the model."""
    r = client.responses.create(model=SERVED, input=QUESTION, tools=[TOOL], tool_choice="none", temperature=0.0)  # type: ignore[list-item]
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.output_text == ANSWER
    assert r.tool_choice == "none"
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        forced = client.responses.create(model=SERVED, input=QUESTION, tools=[TOOL], tool_choice=choice,  # type: ignore[arg-type,list-item]
                                         parallel_tool_calls=False, temperature=0.0)
        (call,) = forced.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == CALL["arguments"] and forced.parallel_tool_calls is False


def test_previous_response_id(client: openai.OpenAI) -> None:
    """A stored response continues with only the new items: the same prompt as the full input
    (the first request's instructions are not carried over, as OpenAI does)."""
    first = client.responses.create(model=SERVED, input=QUESTION, tools=[TOOL], temperature=0.0, store=True,  # type: ignore[list-item]
                                    instructions="Answer briefly.")
    (call,) = first.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = client.responses.create(model=SERVED, previous_response_id=first.id, input=[result],  # type: ignore[list-item]
                                      tools=[TOOL], temperature=0.0)  # type: ignore[list-item]
    full = client.responses.create(model=SERVED, tools=[TOOL], temperature=0.0,  # type: ignore[list-item]
                                   input=[{"role": "user", "content": QUESTION}, call.model_dump(), result])  # type: ignore[list-item]
    assert chained.previous_response_id == first.id and chained.output_text == full.output_text == ANSWER
    assert chained.usage is not None and full.usage is not None
    assert chained.usage.input_tokens == full.usage.input_tokens


def test_encrypted_reasoning_round_trip(client: openai.OpenAI) -> None:
    """include ["reasoning.encrypted_content"] (what stateless clients send): the reasoning item
    carries its text there too, and an item sent back with only that field (content and summary
    left out) renders as the one with its content."""
    r = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, include=["reasoning.encrypted_content"])
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == REASONING
    opaque = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    plain = {"type": "reasoning", "id": reasoning.id, "summary": [], "content": [
        {"type": "reasoning_text", "text": REASONING}]}
    tokens = []
    for item in (opaque, plain, None):
        conversation: list[Any] = [{"role": "user", "content": QUESTION}, *([item] if item else []),
                                   {"role": "assistant", "content": ANSWER}, {"role": "user", "content": QUESTION}]
        again = client.responses.create(model=SERVED, input=conversation, temperature=0.0)
        assert again.usage is not None and again.output_text == ANSWER
        tokens.append(again.usage.input_tokens)
    assert tokens[0] == tokens[1] > tokens[2]


def test_reasoning_item_sent_back(client: openai.OpenAI) -> None:
    """A reasoning output sent back as input renders as the assistant turn's reasoning, as a
    previous response's reasoning does: the two prompts are equal."""
    first = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=True)
    again = [{"role": "user", "content": QUESTION}, *(item.model_dump(exclude_none=True) for item in first.output),
             {"role": "user", "content": QUESTION}]
    full = client.responses.create(model=SERVED, input=again, temperature=0.0)  # type: ignore[arg-type]
    chained = client.responses.create(model=SERVED, input=QUESTION, previous_response_id=first.id, temperature=0.0)
    assert full.output_text == chained.output_text == ANSWER
    assert full.usage is not None and chained.usage is not None
    assert full.usage.input_tokens == chained.usage.input_tokens


ANSWER_SCHEMA = {"type": "object", "properties": {"weather": {"enum": ["sunny", "rainy"]}}, "required": ["weather"],
                 "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(client: openai.OpenAI, stream: bool) -> None:
    """text.format constrains the answer after the think block: the model's own answer is not
    allowed, so the grammar writes one that validates."""
    fmt: Any = {"format": {"type": "json_schema", "name": "weather", "schema": ANSWER_SCHEMA, "strict": True}}
    if stream:
        events = list(client.responses.create(model=SERVED, input=QUESTION, text=fmt, temperature=0.0, stream=True))
        r = events[-1].response  # type: ignore[union-attr]
    else:
        r = client.responses.create(model=SERVED, input=QUESTION, text=fmt, temperature=0.0)
    assert r.status == "completed" and r.output[0].type == "reasoning"
    jsonschema.validate(json.loads(r.output_text), ANSWER_SCHEMA)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    obj = client.responses.create(model=SERVED, input=QUESTION, text={"format": {"type": "json_object"}},
                                  temperature=0.0, max_output_tokens=60)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)
    else:
        assert obj.output_text.lstrip().startswith("{")


def test_store_get_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=True, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.store is True and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    streamed = list(client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=True, stream=True))
    final = streamed[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == ANSWER


def test_input_items(server: tuple[str, FastAPI], client: openai.OpenAI) -> None:
    """A stored response's input items, listed newest first by default, oldest first with
    order "asc", a page at a time (the SDK follows `after` over pages of one)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    sent: list[Any] = [{"role": "user", "content": QUESTION}, call,
                       {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    r = client.responses.create(model=SERVED, input=sent, tools=[TOOL], temperature=0.0, store=True)  # type: ignore[list-item]
    newest_first = client.responses.input_items.list(r.id)
    assert [item.type for item in newest_first.data] == ["function_call_output", "function_call", "message"]
    assert newest_first.has_more is False
    paged = list(client.responses.input_items.list(r.id, limit=1, order="asc"))
    assert [item.id for item in paged] == [item.id for item in reversed(newest_first.data)]
    message, listed_call, output = paged
    assert message.type == "message" and message.role == "user"
    assert [(p.type, p.text) for p in message.content] == [("input_text", QUESTION)]  # type: ignore[union-attr]
    assert listed_call.type == "function_call" and listed_call.arguments == call["arguments"]
    assert output.type == "function_call_output" and output.output == "sunny, 21 C"
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "nope"}, "after"),
                         ({"include": "x"}, "include")):
        bad = httpx.get(f"{server[0]}/v1/responses/{r.id}/input_items", params=query)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_store_is_a_bounded_lru(client: openai.OpenAI) -> None:
    ids = [client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=True,
                                   max_output_tokens=1).id for _ in range(STORE_SIZE)]
    client.responses.retrieve(ids[0])  # now the most recently used
    newest = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=True, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], ids[2], newest.id):
        assert client.responses.retrieve(kept).id == kept
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=SERVED, input=QUESTION, previous_response_id=ids[1])


def test_store_unit() -> None:
    store = ResponseStore(2)
    entries = {k: StoredResponse({"id": k}, []) for k in "abc"}
    for k in "ab":
        store.put(k, entries[k])
    assert store.get("a") is entries["a"]
    store.put("c", entries["c"])
    assert len(store) == 2 and store.get("b") is None and store.get("a") is entries["a"]
    assert store.delete("a") and not store.delete("a")
    off = ResponseStore(0)
    off.put("a", entries["a"])
    assert len(off) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


BAD_BODIES: list[tuple[dict[str, Any], int, str | None]] = [
    ({}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input.0.content"),
    ({"input": [{"role": "user", "content": "hi", "colour": "red"}]}, 400, "input.0.colour"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, 400,
     "input.0.arguments"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": -1.0}, 400, "temperature"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, 400, "include"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]}, 400,
     "input.0.encrypted_content"),
    ({"input": "hi", "reasoning": {"summary": "detailed"}}, 400, "reasoning.summary"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "hi", "background": True}, 400, "background"),
    ({"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "word " * 600}, 400, "input"),
]


def test_bad_bodies(server: tuple[str, FastAPI]) -> None:
    """Each bad body gets its status in OpenAI's error shape, naming the field; the server stays
    healthy and holds no blocks."""
    url, app = server
    for body, status, param in BAD_BODIES:
        r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{url}/v1/responses/resp_nope")
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(app)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=SERVED, input=QUESTION, truncation="auto")
    assert info.value.param == "truncation"  # type: ignore[attr-defined]
    assert client.responses.create(model=SERVED, input=QUESTION, temperature=0.0).output_text == ANSWER
    wait_idle(app)


def test_an_engine_failure_mid_stream(server: tuple[str, FastAPI], model_engine: LLMEngine,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails after the first token ends the stream with an `error` event (the SDK
    parses it) and a non-streamed request with a 500; the server serves on, no block held."""
    step, armed = model_engine.step, [0]

    def flaky_step() -> Any:
        if armed[0] < 2 and any(r.num_output_tokens >= 1 for r in model_engine.scheduler.running):
            armed[0] += 1
            raise RuntimeError("injected step failure")
        return step()

    monkeypatch.setattr(model_engine, "step", flaky_step)
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    events = list(client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, stream=True))
    last = events[-1]
    assert last.type == "error" and "injected step failure" in last.message and last.code == "engine_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert not any(e.type == "response.completed" for e in events)
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=SERVED, input=QUESTION, temperature=0.0)
    assert armed[0] == 2
    assert client.responses.create(model=SERVED, input=QUESTION, temperature=0.0).output_text == ANSWER
    wait_idle(server[1])


def test_documented_no_ops_are_accepted(client: openai.OpenAI) -> None:
    r = client.responses.create(model=SERVED, input=QUESTION, temperature=0.0, store=False, parallel_tool_calls=True,
                                truncation="disabled", user="u", service_tier="auto", metadata={"a": "b"},
                                prompt_cache_key="k", safety_identifier="s", reasoning={"summary": "auto"})
    assert r.output_text == ANSWER and r.metadata == {"a": "b"}


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny, 21 C"


def test_langchain_openai(server: tuple[str, FastAPI]) -> None:
    """LangChain's ChatOpenAI on the Responses API: text, a stream, and a bound tool's call."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=SERVED, base_url=f"{server[0]}/v1", api_key="unused",  # type: ignore[arg-type]
                     use_responses_api=True, temperature=0.0, max_retries=0)
    reply = llm.invoke(QUESTION)
    assert reply.text == ANSWER and reply.response_metadata["id"].startswith("resp_")
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == ANSWER
    called = llm.bind_tools([get_weather]).invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", CALL["arguments"])]
    wait_idle(server[1])


def test_pydantic_ai(server: tuple[str, FastAPI]) -> None:
    """A pydantic-ai agent on OpenAIResponsesModel runs the tool the model calls, sends its
    result back, and gets the answer."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel(SERVED, provider=OpenAIProvider(base_url=f"{server[0]}/v1", api_key="unused"))
    plain = Agent(model, model_settings={"temperature": 0.0})
    answered = plain.run_sync(QUESTION)
    assert answered.output == ANSWER
    assert (answered.all_messages()[-1].provider_response_id or "").startswith("resp_")  # type: ignore[union-attr]
    with_tool = Agent(model, tools=[get_weather], model_settings={"temperature": 0.0})
    result = with_tool.run_sync(QUESTION)
    assert result.output == ANSWER
    kinds = [part.part_kind for message in result.all_messages() for part in message.parts]
    assert kinds.count("tool-call") == 1 and kinds.count("tool-return") == 1
    wait_idle(server[1])


def test_litellm(server: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch) -> None:
    """litellm.responses, with its model price map read from the package (no download); the
    response it stored is there to retrieve, so it went through /v1/responses."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    r = litellm.responses(model=f"openai/{SERVED}", input=QUESTION, api_base=f"{server[0]}/v1", api_key="unused",
                          temperature=0.0, store=True)
    assert r.output[-1].content[0].text == ANSWER  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    # litellm hands out its own id: base64 of "litellm:...;response_id:<the server's id>"
    ours = base64.b64decode(r.id.removeprefix("resp_")).decode().rsplit("response_id:", 1)[1]
    assert client.responses.retrieve(ours).output_text == ANSWER
    wait_idle(server[1])


def test_store_size_zero_stores_nothing(engine: LLMEngine) -> None:
    """`--responses-store-size 0`: `store: true` is a 400 naming it; stateless requests run (on
    the demo model here); a negative size is refused at startup."""
    with serve(engine, responses_store_size=0) as (url, app):
        r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "store": True, "max_output_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"
        r = httpx.post(f"{url}/v1/responses", json={"input": "Hi", "store": False, "max_output_tokens": 2,
                                                      "temperature": 0.0})
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
        wait_idle(app)
    with pytest.raises(ValueError, match="store size"):
        ServerConfig(responses_store_size=-1)


def check_events(events: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """Every event refers to an item added and not yet done; each item is added once, done once,
    and its done form is the final item."""
    state: dict[int, str] = {}
    for e in events:
        index = e["output_index"]
        if e["type"] == "response.output_item.added":
            assert index == len(state) and index not in state
            state[index] = "open"
        else:
            assert state.get(index) == "open", e
            if e["type"] == "response.output_item.done":
                state[index] = "done"
                assert e["item"] == items[index]
    assert list(state.values()) == ["done"] * len(items)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=40))
def test_output_items_for_any_split(cuts: list[int]) -> None:
    """A reply that thinks, writes text, calls two functions with text between, then writes more,
    fed to the real parsers (qwen3 think, hermes) in pieces of any sizes: the events always form
    consistent items, and the items carry exactly the reasoning, text and calls of the whole."""
    from nanoserve.server.chat.output import ChatOutputFormat
    from nanoserve.server.chat.tool_parsers.registry import parser_factory
    from nanoserve.server.serving_responses import OutputItems

    first, second = json.dumps(CALL), json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}})
    text = f"{REASONING}</think>\n\nLet me look.<tool_call>{first}</tool_call> and <tool_call>{second}</tool_call>Done."
    pieces, at = [], 0
    for cut in cuts:
        pieces.append(text[at:at + cut])
        at += cut
    pieces.append(text[at:])
    fmt = ChatOutputFormat(parser_factory("hermes", None), reasoning=True, in_reasoning=True)
    parser = fmt.parser()
    out = OutputItems()
    events = [e for piece in pieces for e in out.push(parser.push(piece))]
    events += out.push(parser.finish()) + out.finish(True)
    check_events(events, out.items)
    assert out.text("reasoning") == REASONING
    whole = fmt.message(text)  # the chat message of the same text, parsed in one piece
    assert out.text("message") == whole["content"] and "Let me look." in whole["content"]
    calls = [(i["name"], i["arguments"]) for i in out.items if i["type"] == "function_call"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert [json.loads(a) for _, a in calls] == [{"city": "Paris"}, {"zone": "UTC"}]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == out.text("message")


def test_a_stream_disconnect_aborts(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that leaves mid-stream aborts its request (the demo model, held after its first
    token so that its reply outlives the client) and frees every block."""
    body = {"input": "Tell me a long story about a dragon.", "max_output_tokens": 100, "temperature": 0.0,
            "stream": True}
    with serve(engine) as (url, app):
        whole = httpx.post(f"{url}/v1/responses", json={**body, "stream": False}, timeout=60).json()
        assert whole["usage"]["output_tokens"] > 10  # long enough to leave it after a few tokens
        generated = engine.num_generated_tokens
        release = hold_after_first_output(engine, monkeypatch)
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        wait_idle(app, timeout=30)  # the abort alone ends it: the engine takes no step meanwhile
        release.set()
        assert engine.num_generated_tokens - generated < whole["usage"]["output_tokens"]
        aborted = 'nanoserve:request_finished_total{finished_reason="abort"}'
        assert metric_value(httpx.get(f"{url}/metrics").text, aborted) == 1
