"""Structured output after reasoning: a reply of a reasoning model is a think block, then the
answer, and a request's output constraint applies to the answer only.

`after_reasoning` wraps a constraint in a Lark grammar (llguidance's dialect) whose start is the
think block (free text up to `</think>`, then up to `MAX_GAP` whitespace characters), then the constraint:

- the reply starts inside the block (the prompt opened it, or the format's replies do, as
  deepseek_r1's): the block's text up to and including `</think>` is required;
- the reply may open a block (as qwen3's may, thinking not switched off): `<think>`, its text and
  `</think>` are optional;
- otherwise (the prompt closed the block) the constraint is left as it is.

A think tag that is one token of the vocabulary (Qwen3's are added tokens) is matched as that
token (`<[id]>`), and the block's text is then any tokens but the end tag and EOS; a tag that is
several tokens is matched as text, the block's text a lexeme that stops at it. A grammar
constraint (Lark, or GBNF converted) has its `start` rule renamed; one that refers to `start`
elsewhere is left as it is (it applies to the whole reply).
"""

from __future__ import annotations

import json
import re

from llguidance.gbnf_to_lark import any_to_lark

from nanoserve.engine.sampling_params import StructuredOutputs
from nanoserve.engine.structured import json_schema_source
from nanoserve.server.chat.reasoning_parsers import END, START
from nanoserve.tokenizer import Tokenizer

# Whitespace allowed between the block and the answer: bounded, or a model could pad with it
# until max_tokens.
MAX_GAP = 4
_START_RULE = re.compile(r"^start(\s*:)", re.MULTILINE)
_START_NAME = re.compile(r"\bstart\b")


def _answer_rules(spec: StructuredOutputs) -> str | None:
    """Lark rules whose `answer` rule is the constraint; None for a grammar that cannot be
    renamed."""
    if spec.json is not None or spec.json_object:
        schema = json_schema_source(spec.json if spec.json is not None else {"type": "object"})
        return f"answer: %json {json.dumps(schema)}\n"
    if spec.regex is not None:
        return "answer: /" + spec.regex.replace("/", "\\/") + "/\n"
    if spec.choice is not None:
        return "answer: " + " | ".join(json.dumps(c) for c in spec.choice) + "\n"
    assert spec.grammar is not None
    try:
        lark = any_to_lark(spec.grammar)
    except Exception:  # not Lark nor GBNF: the compiler reports it
        return None
    renamed, n = _START_RULE.subn(r"answer\1", lark)
    if n != 1 or _START_NAME.search(renamed):
        return None
    return renamed if renamed.endswith("\n") else renamed + "\n"


def _token(tok: Tokenizer, text: str) -> int | None:
    return tok.backend.token_to_id(text)


def after_reasoning(spec: StructuredOutputs, tok: Tokenizer, in_reasoning: bool) -> StructuredOutputs:
    """`spec` applied to the answer after a think block: required when `in_reasoning` (the reply
    starts inside it), else optional (the reply may open one)."""
    answer = _answer_rules(spec)
    if answer is None:
        return spec
    start_id, end_id = _token(tok, START), _token(tok, END)
    if end_id is not None:
        excluded = ",".join(str(i) for i in sorted({end_id, *tok.stop_token_ids}))
        body = f"<[^{excluded}]>* <[{end_id}]>"
    else:
        body = "think_text\n" + f"think_text[stop={json.dumps(END)}]: /(.|\\n)*/"
    opening = f"<[{start_id}]>" if start_id is not None else json.dumps(START)
    if in_reasoning:
        rules = "start: think gap? answer\n"
    else:
        rules = "start: (opened_think gap?)? answer\nopened_think: " + opening + " think\n"
    rules += f"think: {body}\ngap: /[ \\t\\r\\n]{{1,{MAX_GAP}}}/\n"
    return StructuredOutputs(grammar=rules + answer)
