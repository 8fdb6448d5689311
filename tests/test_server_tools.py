"""Tool calling end to end: a real server, the openai SDK, and a real checkpoint that calls a tool.

The checkpoint is a tiny Qwen3 whose attention and MLP outputs are zeroed, so each next token is a
function of the current token alone, and whose LM head is set so that after the generation prompt
it writes `<tool_call>`, one JSON call, `</tool_call>`, then `<|im_end|>` (the three are tokens of
its vocabulary, added to the demo tokenizer). Its chat template is Qwen's format: tools listed in
the system turn, calls between <tool_call> tags, results in <tool_response> tags.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tokenizers
import torch
from fastapi import FastAPI
from safetensors.torch import load_file, save_file
from test_server_helpers import SERVED, make_engine, serve, wait_idle

from nanoserve.tokenizer import Tokenizer

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = json.dumps(CALL)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
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
    tok = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    path = shutil.copytree(make_checkpoint("qwen3", vocab_size=vocab + 3, tie_word_embeddings=False),
                           tmp_path_factory.mktemp("tool-model") / "m")
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in ("<tool_call>", CALL_TEXT, "</tool_call>")])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))

    ids = {t: tok.token_to_id(t) for t in ("<tool_call>", CALL_TEXT, "</tool_call>", "<|im_end|>")}
    after_prompt = Tokenizer.from_pretrained_dir(path).encode_chat(MESSAGES)[-1]  # "assistant\n" in context
    chain = [after_prompt, ids["<tool_call>"], ids[CALL_TEXT], ids["</tool_call>"], ids["<|im_end|>"]]
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()  # every layer adds nothing: the last hidden state is the token's own embedding
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    weights["model.norm.weight"].fill_(1.0)
    head.zero_()
    for current, following in itertools.pairwise(chain):
        head[following] = 50 * embed[current] / embed[current].norm()
    save_file(weights, path / "model.safetensors")
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


def test_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0, n=2)  # type: ignore[arg-type]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL["arguments"]


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS, temperature=0.0,  # type: ignore[arg-type]
                                            stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments or "") == CALL["arguments"]


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
