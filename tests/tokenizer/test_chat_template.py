"""Chat templates: rendering equals transformers' apply_chat_template; the sandbox holds."""

from __future__ import annotations

import copy
import json
from datetime import datetime

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nanoserve.tokenizer import (
    ChatTemplateError,
    ChatTemplateSecurityError,
    Tokenizer,
    render_chat_template,
)

# A ChatML template in the style of Qwen2.5: default system prompt, a tools block, tool calls and
# tool responses, and content given either as a string or as a list of typed parts.
CHATML = r"""
{%- macro text(content) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is iterable -%}
    {%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = text(messages[0].content) -%}
{%- else -%}
  {%- set system = 'You are a helpful assistant.' -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
{{- '\n\n# Tools\n\nYou may call functions. Their signatures are inside <tools></tools>:\n<tools>' }}
  {%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
  {%- endfor %}
{{- '\n</tools>\n\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call> to call one.' }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
  {%- if message.role == 'tool' %}
    {%- if loop.previtem is not defined or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
    {%- if loop.nextitem is not defined or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
  {%- else %}
{{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is defined %}{{ text(message.content) }}{% endif %}
    {%- for call in message.tool_calls | default([]) %}
      {%- set fn = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
      {%- if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}
{{- '}\n</tool_call>' }}
    {%- endfor %}
{{- '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
"""

# A Llama-3 style template: BOS from the tokenizer, a dated system header, tools as JSON in the
# first user turn, `ipython` tool results, and raise_exception on unknown roles.
LLAMA3 = r"""
{{- bos_token }}
{%- if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}
{%- if messages[0].role == 'system' %}
  {%- set system = messages[0].content | trim %}
  {%- set rest = messages[1:] %}
{%- else %}
  {%- set system = '' %}
  {%- set rest = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{ 'Environment: ipython\n' }}{% endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' + system + '<|eot_id|>' }}
{%- set ns = namespace(tools_shown=false) %}
{%- for message in rest %}
  {%- if message.role not in ['user', 'assistant', 'tool', 'ipython'] %}
    {{- raise_exception('Unknown role: ' + message.role) }}
  {%- endif %}
  {%- if message.role == 'user' and tools is not none and not ns.tools_shown %}
    {%- set ns.tools_shown = true %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n'
    + 'Given these functions, reply with JSON {"name": ..., "parameters": ...}.\n\n' }}
    {%- for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\n\n' }}{% endfor %}
{{- message.content | trim + '<|eot_id|>' }}
  {%- elif message.role == 'assistant' and message.tool_calls is defined %}
    {%- set fn = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n'
    + '{"name": "' + fn.name + '", "parameters": ' + fn.arguments + '}<|eot_id|>' }}
  {%- elif message.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
  {%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
"""

# A Mistral style template: [INST] turns that must alternate, the system prompt folded into the
# last user turn, and EOS after each assistant answer.
MISTRAL = r"""
{%- if messages[0].role == 'system' %}
  {%- set system_message = messages[0].content %}
  {%- set turns = messages[1:] %}
{%- else %}
  {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
  {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
    {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif %}
  {%- if message.role == 'user' %}
    {%- if loop.last and system_message is defined %}
{{- '[INST] ' + system_message + '\n\n' + message.content + '[/INST]' }}
    {%- else %}
{{- '[INST] ' + message.content + '[/INST]' }}
    {%- endif %}
  {%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
  {%- else %}
    {{- raise_exception('Only user and assistant roles are supported after an optional system message') }}
  {%- endif %}
{%- endfor %}
"""

SPECIALS = [
    "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eot_id|>", "[INST]", "[/INST]",
]  # fmt: skip
MODELS = {  # name: (template, bos, eos)
    "chatml": (CHATML, None, "<|im_end|>"),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city, e.g. «Zürich» <b>&</b>",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["°C", "°F"]}},
                "required": ["city"],
            },
        },
    }
]
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello! Ça va? 😀"}],
    "system": [
        {"role": "system", "content": "You are terse. Réponds en français."},
        {"role": "user", "content": "Name a 日本 city."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  "},
        {"role": "assistant", "content": "6 🎉"},
        {"role": "user", "content": "Thanks"},
    ],
    "parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "this picture."},
            ],
        }
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "unit": "°C"}'},
    ],
}
CASES = [  # (model, conversation, uses tools)
    *((m, c, False) for m in MODELS for c in ("single", "system", "multi_turn")),
    ("chatml", "parts", False),
    ("chatml", "single", True),
    ("chatml", "tool_calls", True),
    ("llama3", "system", True),
    ("llama3", "tool_calls", True),
]


def _backend() -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [json.dumps(conv, ensure_ascii=False) for conv in CONVERSATIONS.values()] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    return backend


@pytest.fixture(scope="module")
def tokenizers_by_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, object]]:
    backend = _backend()
    out = {}
    for name, (template, bos, eos) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template
        ).save_pretrained(folder)
        out[name] = (Tokenizer.from_pretrained_dir(folder), AutoTokenizer.from_pretrained(folder))
    return out


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize(("model", "conversation", "with_tools"), CASES)
def test_render_matches_transformers(
    tokenizers_by_model, model: str, conversation: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    ours, hf = tokenizers_by_model[model]
    messages = CONVERSATIONS[conversation]
    before = copy.deepcopy(messages)
    kwargs = {"tools": TOOLS if with_tools else None, "date_string": "26 Jul 2024"}
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    want = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    assert got == want
    assert messages == before  # inputs are not mutated
    ids = ours.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    want_ids = hf.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
    )
    assert ids == list(want_ids)


def test_templates_render_what_they_should(tokenizers_by_model) -> None:
    """Guards against vacuous equality (both sides empty or both failing silently)."""
    chatml, llama3, mistral = (tokenizers_by_model[m][0] for m in ("chatml", "llama3", "mistral"))
    tool_prompt = chatml.apply_chat_template(CONVERSATIONS["tool_calls"], tools=TOOLS)
    assert "«Zürich» <b>&</b>" in tool_prompt  # tojson escapes neither HTML nor non-ASCII
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    assert call in tool_prompt
    assert "<|im_start|>user\n<tool_response>\n" in tool_prompt
    assert "Describe this picture." in chatml.apply_chat_template(CONVERSATIONS["parts"])
    today = datetime.now().strftime("%d %b %Y")
    assert llama3.apply_chat_template(CONVERSATIONS["single"]).startswith(
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {today}\n\n<|eot_id|>"
    )
    assert mistral.apply_chat_template(CONVERSATIONS["multi_turn"], add_generation_prompt=False) == (
        "<s>[INST] 2+2?[/INST] 4</s>[INST]   And 3+3?  [/INST] 6 🎉</s>[INST] Be brief.\n\nThanks[/INST]"
    )


@pytest.mark.parametrize(
    ("model", "messages", "message"),
    [
        ("llama3", [{"role": "narrator", "content": "x"}], "Unknown role: narrator"),
        (
            "mistral",
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "Conversation roles must alternate user/assistant/user/assistant/...",
        ),
    ],
)
def test_raise_exception_is_a_value_error_with_the_template_message(
    tokenizers_by_model, model: str, messages: list[dict], message: str
) -> None:
    ours, hf = tokenizers_by_model[model]
    with pytest.raises(ValueError) as ours_error:
        ours.apply_chat_template(messages)
    assert isinstance(ours_error.value, ChatTemplateError)
    assert str(ours_error.value) == message
    with pytest.raises(jinja2.TemplateError) as hf_error:
        hf.apply_chat_template(messages, tokenize=False)
    assert str(hf_error.value) == message


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ (1).__class__.__base__.__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['json'] }}",
        "{{ strftime_now.__code__.co_consts }}",
        "{{ namespace.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
        "{% set _ = messages[0].update({'role': 'x'}) %}",
        "{% set ns = namespace(__class__=1) %}",
        "{% set ns = namespace(a=1) %}{% set ns._hidden = 2 %}",
    ],
)
def test_sandbox_blocks_python_internals(template: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateSecurityError):
        render_chat_template(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_unsafe_attributes_render_as_nothing() -> None:
    assert render_chat_template("[{{ ''.__class__ }}][{{ raise_exception.__globals__ }}]", []) == "[][]"


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ 'x' * 10**7 }}", "more than 1048576 items"),
        ("{{ 10**7 * ['x'] }}", "more than 1048576 items"),
        ("{{ 3 ** (10**8) }}", "a power over 1048576 bits"),
        ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "bits with"),
        ("{{ 'x'.ljust(10**9) }}", "padded a string"),
        ("{{ 'x'.center(width=10**9) }}", "padded a string"),
        ("{{ raise_exception }}", "print a function"),
        ("{{ [strftime_now] }}", "print a function"),
        ("{{ namespace }}", "print a type"),
    ],
)
def test_unbounded_values_and_object_reprs_are_refused(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateSecurityError, match=match):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_bounded_arithmetic_still_renders() -> None:
    template = "{{ 2 ** 64 }} {{ 'ab' * 3 }} {{ [0] * 2 }} {{ 'x'.ljust(3) }}|{{ messages[0] }}"
    assert render_chat_template(template, [{"role": "user", "content": "hi"}]) == (
        "18446744073709551616 ababab [0, 0] x  |{'role': 'user', 'content': 'hi'}")


def test_output_stops_at_its_limit() -> None:
    template = "{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}"
    messages = [{"role": "user", "content": "0123456789"}]
    assert len(render_chat_template(template, messages, output_limit=10_000)) == 10_000
    with pytest.raises(ChatTemplateError, match="passed the limit of 9999 characters"):
        render_chat_template(template, messages, output_limit=9_999)


def test_caller_objects_are_not_reachable() -> None:
    calls: list[str] = []

    class Dangerous:
        def wipe(self) -> str:
            calls.append("wipe")
            return "wiped"

    messages = [{"role": "user", "content": Dangerous()}]
    assert render_chat_template("{{ messages[0].content }}", messages) == "<Dangerous>"
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages[0].content.wipe() }}", messages)
    assert calls == []


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m }}", "line 1"),
        ("{% if %}", "invalid chat template"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages[0].content.missing.deeper }}", "UndefinedError"),
        ("{{ messages | unknown_filter }}", "invalid chat template"),
    ],
)
def test_template_errors_are_value_errors(template: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as error:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert isinstance(error.value, ValueError)


def test_messages_must_be_dicts() -> None:
    with pytest.raises(ValueError, match="must be dicts"):
        render_chat_template("{{ messages }}", ["hello"])  # type: ignore[list-item]


FEATURE_TEMPLATES = {
    "tojson_variants": "{{ tools | tojson }}\n{{ tools | tojson(indent=2) }}\n"
    "{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}\n{{ tools | tojson(ensure_ascii=true) }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}",
    "generation_tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}<{{ m.content }}>{% endif %}{% endfor %}",
    "namespace": "{% set ns = namespace(n=0, roles=[]) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }}",
    "dict_global": "{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x', 'y'], 0) | tojson }}",
    "none_keys_dropped": "{% for m in messages %}{{ m.role }}:{{ 'content' in m }}:{{ m | tojson }}\n"
    "{% endfor %}",
    "reasoning_aliases": "{% for m in messages %}{{ m.reasoning_content | default('-') }}|"
    "{{ m.thinking | default('-') }}|{{ m.content }}\n{% endfor %}",
    "special_tokens": "[{{ bos_token }}][{{ eos_token }}][{{ bos_token is defined }}]",
    "extra_kwargs": "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n"
    "{% endif %}{{ documents is none }}",
    "whitespace_control": "{% for m in messages %}\n    {% if m.content %}\n  {{ m.content }}\n"
    "    {% endif %}\n{% endfor %}\n",
}
FEATURE_MESSAGES = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "<b>é</b> 😀"},
    {"role": "assistant", "content": None, "tool_calls": None, "reasoning": "thought 🤔"},
    {"role": "assistant", "content": "done", "reasoning_content": "why"},
]


@pytest.mark.parametrize("feature", list(FEATURE_TEMPLATES))
@pytest.mark.parametrize("model", ["chatml", "llama3"])
def test_environment_features_match_transformers(tokenizers_by_model, feature: str, model: str) -> None:
    ours, hf = tokenizers_by_model[model]
    template = FEATURE_TEMPLATES[feature]
    kwargs = {"tools": TOOLS, "enable_thinking": False}
    got = render_chat_template(
        template, FEATURE_MESSAGES, bos_token=ours.bos_token, eos_token=ours.eos_token, **kwargs
    )
    want = hf.apply_chat_template(
        FEATURE_MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert got == want
    assert got.strip()


def test_strftime_now() -> None:
    got = render_chat_template("{{ strftime_now('%Y-%m-%d') }}", [])
    assert got == datetime.now().strftime("%Y-%m-%d")


def test_special_tokens_are_undefined_when_absent() -> None:
    template = "[{{ bos_token }}][{{ bos_token is defined }}][{{ eos_token }}]"
    assert render_chat_template(template, [], eos_token="</s>") == "[][False][</s>]"
    assert render_chat_template(template, [], bos_token="<s>", eos_token="</s>") == "[<s>][True][</s>]"


def test_encode_chat_adds_no_special_tokens_beyond_the_template(tokenizers_by_model) -> None:
    ours, _ = tokenizers_by_model["llama3"]
    ids = ours.encode_chat(CONVERSATIONS["single"], date_string="1 Jan 2025")
    assert ids.count(ours.bos_token_id) == 1
    assert ids == ours.encode(ours.apply_chat_template(CONVERSATIONS["single"], date_string="1 Jan 2025"),
                              add_special_tokens=False)  # fmt: skip
