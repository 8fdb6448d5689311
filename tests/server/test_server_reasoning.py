"""Reasoning output end to end: a real server, the openai SDK, and real checkpoints that think.

The checkpoints (`successor_model`) have a Qwen3-style chat template (`enable_thinking: false`
writes an empty think block into the generation prompt) and, like Qwen3, `<think>`, `</think>`
and "\\n\\n" as tokens. After the plain generation prompt ("assistant\\n") they write
`<think>`, one reasoning token, `</think>` and then either "\\n\\n" and an answer or a tool call;
after the prompt with the empty block (ending in "\\n\\n") they answer at once. The reasoning
parser is picked from the template (qwen3).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import tokenizers
from fastapi import FastAPI

from nanoserve.server.protocol.openai import ChatCompletionRequest
from nanoserve.tokenizer import Tokenizer

from support.server import SERVED, make_engine, serve, sse_payloads, wait_idle
from support.successor_model import set_successors, successor_checkpoint
from support.tool_calls import CALL, CALL_PIECES, TOOLS

REASONING = "The user asks about the weather in Paris."
ANSWER = "It is sunny in Paris."
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATE = (  # Qwen3's shape: literal strings, so no newline is lost to whitespace control
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}"
    "{{- '</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + (m.content or '') + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def thinking_model(make_checkpoint: Callable[..., Path], demo_dir: Path, dest: Path, then: list[str]) -> Path:
    """A checkpoint that thinks, then writes the tokens `then` (when thinking is on)."""
    words = ["<think>", "</think>", "\n\n", REASONING, ANSWER, "<tool_call>", *CALL_PIECES, "</tool_call>"]
    path = successor_checkpoint(make_checkpoint, demo_dir, dest, TEMPLATE,
                                [tokenizers.AddedToken(w, normalized=False) for w in words])
    tok = Tokenizer.from_pretrained_dir(path)
    thinking = tok.encode_chat(MESSAGES)[-1]
    direct = tok.encode_chat(MESSAGES, enable_thinking=False)[-1]
    assert thinking != direct == tok.backend.token_to_id("\n\n")
    ids = [tok.backend.token_to_id(w) for w in ["<think>", REASONING, "</think>", *then, "<|im_end|>"]]
    set_successors(path, [[thinking, *ids], [direct, tok.backend.token_to_id(ANSWER), ids[-1]]])
    return path


@pytest.fixture(scope="module")
def think_model(make_checkpoint: Callable[..., Path], demo_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_model(make_checkpoint, demo_dir, tmp_path_factory.mktemp("think-model") / "m",
                          ["\n\n", ANSWER])


@pytest.fixture(scope="module")
def server(think_model: Path) -> Iterator[tuple[str, FastAPI]]:
    with serve(make_engine(think_model, max_model_len=512, num_kv_blocks=128)) as served:
        yield served


@pytest.fixture(scope="module")
def tool_server(make_checkpoint: Callable[..., Path], demo_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FastAPI]]:
    path = thinking_model(make_checkpoint, demo_dir, tmp_path_factory.mktemp("think-tool-model") / "m",
                          ["<tool_call>", *CALL_PIECES, "</tool_call>"])
    with serve(make_engine(path, max_model_len=512, num_kv_blocks=128)) as served:
        yield served


def client_of(served: tuple[str, FastAPI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)


def reasoning_of(message: Any) -> Any:
    return (message.model_extra or {}).get("reasoning_content")


def streamed(url: str, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]], str | None]:
    """Joined reasoning, content, the tool-call entries and the finish reason of a stream; no
    chunk carries any part of a think tag."""
    raw = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **body}, timeout=60)
    reasoning, content, calls, finish = "", "", [], None
    for p in sse_payloads(raw.content):
        for choice in p["choices"]:
            delta = choice["delta"]
            assert "<think" not in json.dumps(delta) and "</th" not in json.dumps(delta)
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return reasoning, content, calls, finish


def test_reasoning_apart_from_the_answer(server: tuple[str, FastAPI]) -> None:
    r = client_of(server).chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
    message = r.choices[0].message
    assert reasoning_of(message) == REASONING and message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    assert streamed(server[0], {"temperature": 0.0}) == (REASONING, ANSWER, [], "stop")
    wait_idle(server[1])


def test_enable_thinking_false(server: tuple[str, FastAPI]) -> None:
    """The kwarg reaches the template: the prompt gains the empty block (4 tokens) and the model,
    seeing it, answers at once; the reply has no reasoning."""
    client = client_of(server)
    thinking = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0, extra_body=NO_THINKING)  # type: ignore[arg-type]
    assert r.choices[0].message.content == ANSWER and reasoning_of(r.choices[0].message) is None
    assert r.usage is not None and thinking.usage is not None
    assert r.usage.prompt_tokens == thinking.usage.prompt_tokens + 4 and r.usage.completion_tokens == 2
    assert streamed(server[0], {"temperature": 0.0, **NO_THINKING}) == ("", ANSWER, [], "stop")
    wait_idle(server[1])


def test_cut_inside_the_block_is_all_reasoning(server: tuple[str, FastAPI]) -> None:
    r = client_of(server).chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0, max_tokens=2)  # type: ignore[arg-type]
    assert reasoning_of(r.choices[0].message) == REASONING and r.choices[0].message.content is None
    assert r.choices[0].finish_reason == "length"
    assert streamed(server[0], {"temperature": 0.0, "max_tokens": 2}) == (REASONING, "", [], "length")


def test_reasoning_parser_none(think_model: Path) -> None:
    """`--reasoning-parser none`: the text as generated, tags and all."""
    with serve(make_engine(think_model, max_model_len=512, num_kv_blocks=128), reasoning_parser="none") as served:
        r = client_of(served).chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
        assert r.choices[0].message.content == f"<think>{REASONING}</think>\n\n{ANSWER}"
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"tools": None}, {"add_generation_prompt": False},
                                    {"not a name": 1}, {"_private": 1}, ["enable_thinking"]])
def test_bad_chat_template_kwargs(server: tuple[str, FastAPI], kwargs: Any) -> None:
    r = httpx.post(f"{server[0]}/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("chat_template_kwargs")


def test_template_kwargs_reach_the_template(server: tuple[str, FastAPI]) -> None:
    tok = server[1].state.engine.info.tokenizer
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **NO_THINKING})
    messages = [m.to_template() for m in body.messages]
    assert tok.apply_chat_template(messages, **body.template_kwargs()).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(messages).endswith("assistant\n")


def test_tool_call_after_reasoning(tool_server: tuple[str, FastAPI]) -> None:
    """The tool parser reads the content after the think block; streamed, the call comes name
    first, and its argument deltas join to the non-streamed call's arguments."""
    r = client_of(tool_server).chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                                       temperature=0.0)
    message = r.choices[0].message
    (call,) = message.tool_calls or []
    assert reasoning_of(message) == REASONING and message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]
    reasoning, content, calls, finish = streamed(tool_server[0], {"tools": TOOLS, "temperature": 0.0})
    assert (reasoning, content, finish) == (REASONING, "", "tool_calls")
    # the name first, then the arguments in their two steps' chunks (merged into one for a slow reader)
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and len(calls) in (2, 3)
    assert "".join(c["function"]["arguments"] for c in calls) == call.function.arguments
    without_tools = client_of(tool_server).chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0)  # type: ignore[arg-type]
    assert without_tools.choices[0].message.content == f"<tool_call>{''.join(CALL_PIECES)}</tool_call>"
    wait_idle(tool_server[1])


ANSWER_SCHEMA = {"type": "object", "properties": {"weather": {"enum": ["sunny", "rainy"]}}, "required": ["weather"],
                 "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": ANSWER_SCHEMA}}}


@pytest.mark.parametrize("body", [JSON_SCHEMA_FORMAT, {"guided_choice": ["sunny", "rainy"]}])
def test_structured_output_after_reasoning(server: tuple[str, FastAPI], body: dict[str, Any]) -> None:
    """The model thinks (its think tags are added tokens) and the constraint applies to the
    answer after `</think>`: the reasoning is the model's own, the content is constrained (the
    model's own answer is not allowed, so the grammar picks it); streamed and not alike."""
    def check(reasoning: Any, content: Any, finish: Any) -> None:
        assert reasoning == REASONING and finish == "stop"
        if "guided_choice" in body:
            assert content in ("sunny", "rainy")
        else:
            jsonschema.validate(json.loads(content), ANSWER_SCHEMA)

    r = httpx.post(f"{server[0]}/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0.0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check(choice["message"]["reasoning_content"], choice["message"]["content"], choice["finish_reason"])
    reasoning, content, _, finish = streamed(server[0], {"temperature": 0.0, **body})
    check(reasoning, content, finish)
    assert content == choice["message"]["content"]
    # Thinking switched off: the prompt closed the block, and the whole reply is the answer.
    off = client_of(server).chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0,  # type: ignore[arg-type]
                                                    extra_body={**body, **NO_THINKING})
    assert reasoning_of(off.choices[0].message) is None
    check(REASONING, off.choices[0].message.content, off.choices[0].finish_reason)
    wait_idle(server[1])


@pytest.mark.parametrize("tags_are_tokens", [True, False])
def test_reasoning_grammar_shapes(think_model: Path, demo_dir: Path, tags_are_tokens: bool) -> None:
    """The wrapped grammar: a required block when the reply starts inside one, an optional one
    when it may open one; think tags that are one token (the think model's) are matched by id,
    others (the demo tokenizer's) as text."""
    from nanoserve.engine.sampling_params import StructuredOutputs
    from nanoserve.engine.structured import GrammarCompiler
    from nanoserve.server.chat.reasoning_grammar import after_reasoning

    tok = Tokenizer.from_pretrained_dir(think_model if tags_are_tokens else demo_dir)
    compiler = GrammarCompiler(tok)
    spec = StructuredOutputs(json=ANSWER_SCHEMA)
    answer = '{"weather": "rainy"}'
    for in_reasoning, text, accepted in [
        (True, f"{REASONING} and < more</think>\n\n{answer}", True),
        (True, f"{REASONING}</think>{answer}", True),
        (True, answer, False),  # the block is required
        (False, f"<think>{REASONING}</think>\n\n{answer}", True),
        (False, answer, True),
        (False, f"{REASONING}{answer}", False),
    ]:
        wrapped = after_reasoning(spec, tok, in_reasoning)
        assert wrapped.grammar is not None and ("<[" in wrapped.grammar) is tags_are_tokens
        matcher = compiler.compile(wrapped).deep_copy()
        ids = tok.encode(text, add_special_tokens=False)
        ok = matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
        assert ok is accepted, (in_reasoning, text, wrapped.grammar)


@pytest.mark.parametrize(("effort", "thinks"), [("none", False), ("minimal", False), ("low", True), ("high", True)])
def test_reasoning_effort_switches_thinking(server: tuple[str, FastAPI], effort: str, thinks: bool) -> None:
    """`reasoning_effort` reaches the template as `enable_thinking` (false for "none" and
    "minimal"); `chat_template_kwargs` wins over it."""
    client = client_of(server)
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=0.0,  # type: ignore[arg-type]
                                       reasoning_effort=effort)  # type: ignore[arg-type]
    assert r.choices[0].message.content == ANSWER
    assert reasoning_of(r.choices[0].message) == (REASONING if thinks else None)
    overridden = client.chat.completions.create(
        model=SERVED, messages=MESSAGES, temperature=0.0, reasoning_effort=effort,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": not thinks}})
    assert reasoning_of(overridden.choices[0].message) == (None if thinks else REASONING)
    wait_idle(server[1])


def test_template_variables_of_the_effort_fields() -> None:
    def kwargs(**fields: Any) -> dict[str, Any]:
        return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}).template_kwargs()

    assert kwargs() == {}
    assert kwargs(reasoning_effort="minimal", verbosity="low") == {
        "enable_thinking": False, "reasoning_effort": "minimal", "verbosity": "low"}
    assert kwargs(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}) == {
        "enable_thinking": True, "reasoning_effort": "low"}


@pytest.mark.parametrize("thinking", [True, False])
def test_pydantic_ai_vllm_provider(think_model: Path, thinking: bool) -> None:
    """pydantic-ai's vLLM provider, with its unified `thinking` setting, on a model it takes for a
    Qwen3 (by the served name): the reasoning comes back as a thinking part, or not at all."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ThinkingPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.vllm import VLLMProvider

    name = "qwen3-think"
    with serve(make_engine(think_model, max_model_len=512, num_kv_blocks=128), served_model_name=name) as (url, app):
        model = OpenAIChatModel(name, provider=VLLMProvider(base_url=f"{url}/v1", api_key="unused"))
        agent = Agent(model, model_settings={"thinking": thinking, "temperature": 0.0})
        result = agent.run_sync(MESSAGES[0]["content"])
        assert result.output == ANSWER
        thoughts = [p.content for m in result.all_messages() for p in getattr(m, "parts", [])
                    if isinstance(p, ThinkingPart)]
        assert thoughts == ([REASONING] if thinking else [])
        wait_idle(app)
