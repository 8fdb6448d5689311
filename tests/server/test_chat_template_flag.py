"""`--chat-template FILE_OR_STRING` (vLLM's flag): the model's template replaced for every chat
prompt the server renders, the tool-call parser read from the replacement ("auto"), and the 400 for
a `tools` request naming the `--tool-call-parser` to pass where no template shows a format."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from nanoserve.cli import build_parser
from nanoserve.engine.args import EngineArgs
from nanoserve.runtime.builder import build_engine
from nanoserve.runtime.llm import LLM
from nanoserve.tokenizer import Tokenizer, render_chat_template
from nanoserve.tokenizer.chat_template import ChatTemplateError, load_chat_template

from support.server import ENGINE_ARGS, SERVED, make_engine, serve, wait_idle

# Hermes-shaped: shows `<tool_call>`, so "auto" picks the hermes parser.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }} says\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LITERAL = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}ASSISTANT:"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "hermes-ish.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def demo_tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(demo_dir)


@pytest.fixture(scope="module")
def overridden(demo_dir: Path, template_file: Path) -> Iterator[tuple[str, Any]]:
    with serve(make_engine(demo_dir, chat_template=str(template_file), max_model_len=512)) as served:
        yield served


def test_file_template_renders_chat_prompts(overridden: tuple[str, Any], demo_tokenizer: Tokenizer) -> None:
    url, app = overridden
    want = demo_tokenizer.encode(render_chat_template(TEMPLATE, MESSAGES, add_generation_prompt=True),
                                 add_special_tokens=False)
    assert want != demo_tokenizer.encode_chat(MESSAGES)  # the demo model's own template renders otherwise
    r = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200 and r.json()["tokens"] == want
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(want)
    wait_idle(app)


def test_tool_parser_is_read_from_the_overriding_template(overridden: tuple[str, Any],
                                                          server: tuple[str, Any]) -> None:
    """With the replacement (it shows `<tool_call>`) a `tools` request is served; on the demo
    model's own template, which shows no format, it is a 400 naming the flag and its values."""
    for url, ok in ((overridden[0], True), (server[0], False)):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ask = {"model": SERVED, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
               "max_tokens": 4}
        if ok:
            reply = client.chat.completions.create(**ask)
            assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
        else:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(**ask)
            error = e.value.body["error"] if isinstance(e.value.body, dict) and "error" in e.value.body \
                else e.value.body
            assert isinstance(error, dict) and error["param"] == "tools"
            assert "--tool-call-parser hermes, llama3_json or mistral" in error["message"]
            assert "--chat-template" in error["message"]
    wait_idle(overridden[1])
    wait_idle(server[1])


def test_literal_template_in_the_offline_api(demo_dir: Path, demo_tokenizer: Tokenizer) -> None:
    llm = LLM(str(demo_dir), chat_template=LITERAL, **ENGINE_ARGS)
    out = llm.chat(MESSAGES)
    assert out[0].prompt_token_ids == demo_tokenizer.encode(
        "SYSTEM: Be brief.\nUSER: Hello there\nASSISTANT:", add_special_tokens=False)


def test_a_long_literal_is_not_taken_for_a_path() -> None:
    """Real templates run to thousands of characters: more than a file name may hold."""
    long = "{# " + "x" * 5000 + " #}" + LITERAL
    assert load_chat_template(long) == long


@pytest.mark.parametrize(("value", "message"), [
    ("no/such/template.jinja", "no such file, and not a Jinja template"),
    ("{% for m in messages %}{{ m.content }}", "invalid chat template"),
])
def test_bad_value_is_refused_at_startup(demo_dir: Path, value: str, message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        build_engine(EngineArgs(model=str(demo_dir), chat_template=value, **ENGINE_ARGS))


@pytest.mark.parametrize("command", ["serve", "chat", "generate"])
def test_every_model_command_takes_the_flag(command: str, template_file: Path) -> None:
    extra = ["--prompt", "hi"] if command == "generate" else []
    ns = build_parser().parse_args([command, "--chat-template", str(template_file), *extra])
    assert ns.chat_template == str(template_file)
