"""Reasoning parsers: the think block apart from the answer, from whole texts and from any split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.server.chat.reasoning_parsers import ThinkParser, reasoning_parser_name, starts_in_reasoning


def run(in_reasoning: bool, chunks: list[str]) -> tuple[str, str]:
    parser = ThinkParser(in_reasoning)
    parts = [parser.push(c) for c in chunks] + [parser.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


CASES = [  # (starts in reasoning, text, reasoning, content)
    (False, "<think>\nThe user asks.\n</think>\n\nIt is sunny.", "\nThe user asks.\n", "It is sunny."),
    (True, "<think>\nThe user asks.\n</think>\n\nIt is sunny.", "\nThe user asks.\n", "It is sunny."),
    (True, "The user asks.\n</think>\n\nIt is sunny.", "The user asks.\n", "It is sunny."),  # opened by the prompt
    (False, "It is sunny.", "", "It is sunny."),
    (False, "  It is < 30 C.", "", "  It is < 30 C."),
    (False, "<think>cut short, still thinking", "cut short, still thinking", ""),
    (True, "still thinking </thi", "still thinking </thi", ""),
    (False, "<thi", "", "<thi"),
    (True, "", "", ""),
    (False, "<think></think>", "", ""),
    (False, "<think>a</think>b</think>c", "a", "b</think>c"),
    (False, "answer first <think>not a block</think>", "", "answer first <think>not a block</think>"),
    (False, "<think>a</think>\n\n<tool_call>{}</tool_call>", "a", "<tool_call>{}</tool_call>"),
]


@pytest.mark.parametrize(("in_reasoning", "text", "reasoning", "content"), CASES)
def test_split(in_reasoning: bool, text: str, reasoning: str, content: str) -> None:
    assert run(in_reasoning, [text]) == (reasoning, content)
    assert run(in_reasoning, list(text)) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_result(data: st.DataObject) -> None:
    in_reasoning, text, reasoning, content = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert run(in_reasoning, chunks) == (reasoning, content)


def test_no_partial_tag_is_sent() -> None:
    parser = ThinkParser(False)
    assert parser.push("<thi") == ("", "")
    assert parser.push("nk>Hm</th") == ("Hm", "")
    assert parser.push("ink>\n") == ("", "")
    assert parser.push("\nYes") == ("", "Yes")


@pytest.mark.parametrize(("name", "tail", "expected"), [
    ("qwen3", "<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),  # a template that opens the block
    ("deepseek_r1", "<｜Assistant｜>", True),
    ("deepseek_r1", "<｜Assistant｜><think>\n", True),
    ("deepseek_r1", "<｜Assistant｜></think>", False),  # thinking switched off
    ("deepseek_r1", "<think>old</think> more prompt", True),
])
def test_starts_in_reasoning(name: str, tail: str, expected: bool) -> None:
    assert starts_in_reasoning(name, tail) is expected


def test_reasoning_parser_name() -> None:
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert reasoning_parser_name("auto", qwen3) == "qwen3"
    assert reasoning_parser_name("auto", "<｜Assistant｜><think>\n ... </think>") == "deepseek_r1"
    assert reasoning_parser_name("auto", "plain") is None and reasoning_parser_name("auto", None) is None
    assert reasoning_parser_name("none", qwen3) is None
    assert reasoning_parser_name("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser_name("granite", None)
