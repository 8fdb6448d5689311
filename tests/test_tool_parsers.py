"""Tool-call parsers: calls and content from whole texts, and the same from any split into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.tool_parsers import HermesParser, Llama3JsonParser, ToolCall, parser_factory

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False))
TIME = ToolCall("get_time", "{}")


def run(parser_cls, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    parser = parser_cls()
    content, calls = [], []
    for c in chunks:
        text, done = parser.push(c)
        content.append(text)
        calls += done
    text, done = parser.finish()
    return "".join(content) + text, calls + done


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>',
     "", [WEATHER]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}</tool_call>',
     "Let me check.\n", [WEATHER]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "", [WEATHER, TIME]),
    ('<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', "", [TIME]),  # arguments pre-encoded
    ('<tool_call>{"name": "get_time"}', "", [TIME]),  # no closing tag: EOS came first
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("<tool_call>{unfinished", "<tool_call>{unfinished", []),
    ("a < b, and <tool_ is not a tag", "a < b, and <tool_ is not a tag", []),
    ("ends with <tool_c", "ends with <tool_c", []),
    ("plain answer", "plain answer", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text: str, content: str, calls: list[ToolCall]) -> None:
    assert run(HermesParser, [text]) == (content, calls)
    assert run(HermesParser, list(text)) == (content, calls)  # one character at a time


def test_hermes_holds_back_a_possible_tag_only() -> None:
    parser = HermesParser()
    assert parser.push("Hello <tool") == ("Hello ", [])
    assert parser.push("box>") == ("<toolbox>", [])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}', "", [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
     '{"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
    ('  \n{"name": "get_time", "arguments": {}}', "", [TIME]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "get_time", "parameters": {}} and then text', '{"name": "get_time", "parameters": {}} and then text',
     []),
    ("The weather is fine.", "The weather is fine.", []),
    ("<|python", "<|python", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str, calls: list[ToolCall]) -> None:
    assert run(Llama3JsonParser, [text]) == (content, calls)
    assert run(Llama3JsonParser, list(text)) == (content, calls)


def test_llama3_json_streams_content_at_once() -> None:
    parser = Llama3JsonParser()
    assert parser.push(" The") == (" The", [])
    assert parser.push(" weather") == (" weather", [])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_result(data: st.DataObject) -> None:
    cls, cases = data.draw(st.sampled_from([(HermesParser, HERMES_CASES), (Llama3JsonParser, LLAMA_CASES)]))
    text, content, calls = data.draw(st.sampled_from(cases))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(cls, chunks) == (content, calls)


def test_parser_factory() -> None:
    assert parser_factory("auto", "{{ '<tool_call>' }}") is HermesParser
    assert parser_factory("auto", "<|python_tag|>") is Llama3JsonParser
    assert parser_factory("auto", "plain") is None and parser_factory("auto", None) is None
    assert parser_factory("none", "<tool_call>") is None
    assert parser_factory("hermes", None) is HermesParser
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_factory("pythonic", None)
