"""Tool-call parsers: calls and content from whole texts, and the same from any split into deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.chat.tool_parsers.calls import ToolCall, ToolCallDelta, join_calls
from nanoserve.server.chat.tool_parsers.hermes import HermesParser
from nanoserve.server.chat.tool_parsers.json_list import JsonListParser
from nanoserve.server.chat.tool_parsers.llama3_json import Llama3JsonParser
from nanoserve.server.chat.tool_parsers.mistral import MistralParser
from nanoserve.server.chat.tool_parsers.registry import parser_factory

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False))
TIME = ToolCall("get_time", "{}")


def deltas(parser_cls, chunks: list[str]) -> tuple[str, list[ToolCallDelta]]:
    parser = parser_cls()
    content, calls = [], []
    for c in chunks:
        text, new = parser.push(c)
        content.append(text)
        calls += new
    text, new = parser.finish()
    return "".join(content) + text, calls + new


def run(parser_cls, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    content, calls = deltas(parser_cls, chunks)
    return content, join_calls(calls)


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
    ('{"name": "get_time", "parameters": {}} and then text', "and then text", [TIME]),  # a call is committed
    ('{"name": "get_time"}', "", [TIME]),  # not a streamable header: decoded whole
    ('{"name": "get_time", "parameters": {}}; {"name": "x"} ; {"name": "get_weather", "parameters": '
     '{"city": "Paris", "unit": "°C"}}', "", [TIME, ToolCall("x", "{}"), WEATHER]),
    ('{"name": "get_time", "parameters": {}}; {"oops": 1}', '{"oops": 1}', [TIME]),
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


MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]', "", [WEATHER]),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}, '
     '{"name": "get_time", "arguments": {}}]', "", [WEATHER, TIME]),
    ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": "{}"}]', "Sure.", [TIME]),  # decoded whole
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}', "", [WEATHER]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [WEATHER, TIME]),
    ('[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS] {}', "", [TIME]),
    ("[TOOL_CALLS]not a name[ARGS]{}", "[TOOL_CALLS]not a name[ARGS]{}", []),
    ("[TOOL_CALLS]get_time[ARGS]oops", "[TOOL_CALLS]get_time[ARGS]oops", []),
    ("[TOOL_CALLS]get_time", "[TOOL_CALLS]get_time", []),  # cut before [ARGS]
    ("[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("[TOOL_CALLS][", "[TOOL_CALLS][", []),
    ("a [TOOL_CALL is not the tag", "a [TOOL_CALL is not the tag", []),
    ("plain answer", "plain answer", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral(text: str, content: str, calls: list[ToolCall]) -> None:
    assert run(MistralParser, [text]) == (content, calls)
    assert run(MistralParser, list(text)) == (content, calls)


@pytest.mark.parametrize(("cls", "text"), [
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"q": "a}\\"{b", "n": [1, {"x": 2}]}}</tool_call>'),
    (Llama3JsonParser, '{"name": "f", "parameters": {"q": "a}\\"{b", "n": [1, {"x": 2}]}}'),
    (MistralParser, '[TOOL_CALLS]f[ARGS]{"q": "a}\\"{b", "n": [1, {"x": 2}]}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"q": "a}\\"{b", "n": [1, {"x": 2}]}}]'),
])
def test_arguments_stream_as_they_arrive(cls: type, text: str) -> None:
    """One character at a time: the name comes first with empty arguments, as soon as the
    arguments object opens; then the arguments, exactly as generated, each character at once
    (braces and quotes inside strings do not end the object)."""
    args = '{"q": "a}\\"{b", "n": [1, {"x": 2}]}'
    content, out = deltas(cls, list(text))
    assert content == "" and out[0] == ToolCallDelta(0, "f", "")
    assert all(d.index == 0 and d.name is None and len(d.arguments) == 1 for d in out[1:])
    assert "".join(d.arguments for d in out) == args and json.loads(args)["q"] == 'a}"{b'


def test_name_is_sent_before_the_arguments_end() -> None:
    parser = HermesParser()
    assert parser.push('<tool_call>{"name": "get_weather", "argu') == ("", [])
    assert parser.push('ments": {"ci') == ("", [ToolCallDelta(0, "get_weather"), ToolCallDelta(0, None, '{"ci')])
    assert parser.push('ty": "Paris"}}</tool_') == ("", [ToolCallDelta(0, None, 'ty": "Paris"}')])
    assert parser.push("call>\n") == ("", [])
    assert parser.finish() == ("", [])


def test_arguments_cut_short_are_sent_as_generated() -> None:
    """A call committed before the output was cut (max_tokens) keeps the arguments it got."""
    assert run(HermesParser, ['<tool_call>{"name": "f", "arguments": {"city": "Pa']) == (
        "", [ToolCall("f", '{"city": "Pa')])


JSON_LIST_CASES = [
    ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}]', "", [WEATHER]),
    ('[{"name":"get_weather","arguments":{"city":"Paris","unit":"°C"}},{"name":"get_time","arguments":{}}]',
     "", [ToolCall("get_weather", '{"city":"Paris","unit":"°C"}'), ToolCall("get_time", "{}")]),
    ('[\n  {"name": "get_time", "arguments": {}}\n]', "", [TIME]),
    ('[{"name": "get_time", "arguments": {"a": [1, "]"]', "", [ToolCall("get_time", '{"a": [1, "]"]')]),  # cut short
    ('[{"oops": 1}]', '{"oops": 1}]', []),  # not a call (no grammar applied): content
]


@pytest.mark.parametrize(("text", "content", "calls"), JSON_LIST_CASES)
def test_json_list(text: str, content: str, calls: list[ToolCall]) -> None:
    assert run(JsonListParser, [text]) == (content, calls)
    assert run(JsonListParser, list(text)) == (content, calls)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_result(data: st.DataObject) -> None:
    cls, cases = data.draw(st.sampled_from([(HermesParser, HERMES_CASES), (Llama3JsonParser, LLAMA_CASES),
                                            (MistralParser, MISTRAL_CASES),
                                            (JsonListParser, JSON_LIST_CASES)]))
    text, content, calls = data.draw(st.sampled_from(cases))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(cls, chunks) == (content, calls)


def test_parser_factory() -> None:
    assert parser_factory("auto", "{{ '<tool_call>' }}") is HermesParser
    assert parser_factory("auto", "<|python_tag|>") is Llama3JsonParser
    assert parser_factory("auto", "{%- if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]") is MistralParser
    assert parser_factory("auto", "plain") is None and parser_factory("auto", None) is None
    assert parser_factory("none", "<tool_call>") is None
    assert parser_factory("hermes", None) is HermesParser
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser_factory("pythonic", None)
