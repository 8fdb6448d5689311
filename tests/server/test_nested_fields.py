"""Unknown fields inside nested parts of a request body (`stream_options`, a tool, `text.format`,
a content part, ...), through a real server on loopback: each is a 400 in OpenAI's error shape
whose `param` is the field's whole path, while the nested fields real clients send keep working,
and after either the server serves on with every KV block free."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from support.server import SERVED, wait_idle

USER = [{"role": "user", "content": "Hi"}]
CHAT: dict[str, Any] = {"model": SERVED, "messages": USER, "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": SERVED, "prompt": "Once upon", "max_tokens": 2}
RESPONSE: dict[str, Any] = {"model": SERVED, "input": "Hi", "max_output_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

REFUSED: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("/v1/chat/completions", CHAT, {"stream": True, "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", CHAT, {"tools": [{**TOOL, "cache_control": {"type": "ephemeral"}}]},
     "tools.0.cache_control"),
    ("/v1/chat/completions", CHAT, {"tools": [{**TOOL, "function": {**TOOL["function"], "examples": [{}]}}]},
     "tools.0.function.examples"),
    ("/v1/chat/completions", CHAT, {"tools": [TOOL], "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_time", "x": 1}}},
     "tool_choice.function.x"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True, "additionalProperties": False}}},
     "response_format.json_schema.additionalProperties"),
    ("/v1/chat/completions", CHAT, {"response_format": {"type": "json_object", "schema": SCHEMA}},
     "response_format.schema"),
    ("/v1/chat/completions", CHAT, {"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/chat/completions", CHAT, {"prediction": {"type": "content", "content": "Hi", "weight": 2}},
     "prediction.weight"),
    ("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]},
     "messages.0.content.0.cache_control"),
    ("/v1/completions", COMPLETION, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/responses", RESPONSE, {"stream": True, "stream_options": {"include_usage": True}},
     "stream_options.include_usage"),
    ("/v1/responses", RESPONSE, {"text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA,
                                                     "foo": 1}}}, "text.format.foo"),
    ("/v1/responses", RESPONSE, {"text": {"format": {"type": "text"}, "language": "fr"}}, "text.language"),
    ("/v1/responses", RESPONSE, {"reasoning": {"summary": "auto", "mode": "pro"}}, "reasoning.mode"),
    ("/v1/responses", RESPONSE, {"tools": [{"type": "function", "name": "get_time", "parameters": None,
                                            "strict": True, "defer_loading": True}]}, "tools.0.defer_loading"),
    ("/v1/responses", RESPONSE, {"tools": [{"type": "function", "name": "get_time", "parameters": None,
                                            "strict": True, "output_schema": SCHEMA}]}, "tools.0.output_schema"),
    ("/v1/responses", RESPONSE, {"tool_choice": {"type": "function", "name": "get_time", "x": 1}}, "tool_choice.x"),
    ("/v1/responses", RESPONSE, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi",
                                                                         "detail": "high"}]}]},
     "input.0.content.0.detail"),
    ("/v1/responses", RESPONSE, {"input": [{"type": "function_call", "call_id": "c", "name": "get_time",
                                            "arguments": "{}", "namespace": "clock"}]}, "input.0.namespace"),
    ("/v1/responses", RESPONSE, {"input": [{"type": "reasoning", "summary": [
        {"type": "summary_text", "text": "hmm", "signature": "s"}]}, {"role": "user", "content": "Hi"}]},
     "input.0.summary.0.signature"),
]


@pytest.mark.parametrize(("path", "base", "change", "param"), REFUSED, ids=[r[3] for r in REFUSED])
def test_an_unknown_nested_field_is_a_400_naming_its_path(server: tuple[str, FastAPI], path: str,
                                                          base: dict[str, Any], change: dict[str, Any],
                                                          param: str) -> None:
    url, app = server
    r = httpx.post(f"{url}{path}", json={**base, **change}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_field", "invalid_request_error")
    assert f"{param}: unsupported field" in error["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(app)


def test_unknown_nested_fields_sent_as_null_are_unset(server: tuple[str, FastAPI]) -> None:
    """null means unset, nested as at the top level: the same reply as without the field."""
    url, app = server
    plain = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "temperature": 0.0}, timeout=60)
    nulls = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        **CHAT, "temperature": 0.0, "stream_options": {"continuous_usage_stats": None},
        "response_format": {"type": "text", "json_schema": None, "schema": None}})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    wait_idle(app)


def test_the_nested_fields_clients_send_are_taken(server: tuple[str, FastAPI]) -> None:
    """What the OpenAI SDK writes in the nested parts (its typed params, every field set) runs."""
    url, app = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=4,
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "description": "an a", "schema": SCHEMA,
                                                                "strict": True}},
        tools=[{"type": "function", "function": {**TOOL["function"], "description": "now", "strict": True}}],
        tool_choice="none", prediction={"type": "content", "content": [{"type": "text", "text": "{\"a\": 1}"}]}))
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 4
    first = client.responses.create(model=SERVED, input="Hi", max_output_tokens=3, temperature=0.0,
                                    text={"format": {"type": "text"}, "verbosity": "medium"},
                                    reasoning={"summary": "auto", "generate_summary": None})
    assert first.status in ("completed", "incomplete") and first.output
    # the reply's output items sent back as they came (output_text parts carry annotations and logprobs)
    again = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": "And?"}]
    assert all("annotations" in part for item in again[1:-1] for part in item["content"])
    events = list(client.responses.create(
        model=SERVED, input=again, max_output_tokens=3, stream=True, stream_options={"include_obfuscation": False},
        tools=[{"type": "function", "name": "get_time", "description": "now",
                "parameters": TOOL["function"]["parameters"], "strict": True}], tool_choice="none",
        text={"format": {"type": "json_schema", "name": "a", "description": "an a", "schema": SCHEMA, "strict": True}}))
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    wait_idle(app)


def test_openapi_says_nested_models_take_unknown_fields_only_as_null(server: tuple[str, FastAPI]) -> None:
    """Every nested model of every body says what it does with unknown fields: null only (a chat
    message, whose other fields go to the chat template, any)."""
    schemas = httpx.get(f"{server[0]}/openapi.json", timeout=30).json()["components"]["schemas"]
    nested = {name for name in schemas if name not in ("ErrorResponse", "AnthropicErrorResponse")}
    assert {"FunctionTool", "TextConfig", "TextFormat", "ReasoningConfig", "ToolDefinition", "ResponseFormat",
            "ContentPart", "TextPart", "TextBlock"} <= nested
    lenient = {name: schemas[name].get("additionalProperties") for name in nested
               if schemas[name].get("additionalProperties") != {"type": "null"}}
    assert lenient == {"ChatMessage": True}, lenient


def test_a_body_nested_too_deep_is_a_400(server: tuple[str, FastAPI]) -> None:
    """The path of a bad field is looked up in the body sent; a body too deep for that lookup (or
    for the parser) is still a 400, and the server serves on."""
    url, app = server
    deep = f'{{"model": "{SERVED}", "messages": [{{"role": "user", "content": "Hi"}}], "tools": ' + \
        "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(f"{url}/v1/chat/completions", content=deep.encode(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(app)
