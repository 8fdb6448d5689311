"""Request bodies of the OpenAI API (and vLLM's extras), as strict pydantic models.

Invariants: types are checked strictly (a string is never coerced to a number), so a wrong type is
a 400 naming the field; every field is optional where the SDK may send `null`, and `null` means
the default; unknown fields are kept in `model_extra`, where the handler refuses them (a 400
naming the field: see `Serving.check_request`); a nested model (a tool, `stream_options`,
`response_format`, ...) refuses its own (`NestedModel`), except a chat message, whose other fields
(`tool_calls`, `tool_call_id`, `reasoning_content`, ...) are the chat template's to read. Ranges
are checked once, by `SamplingParams.validate`, when `sampling_params` builds the engine's params.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from nanoserve.engine.sampling_params import SamplingParams, StructuredOutputs
from nanoserve.server.protocol.errors import APIError, bad_request
from nanoserve.server.protocol.nested import NestedModel

_CONFIG = ConfigDict(strict=True, extra="allow")
_SEED_BOUND = 2**63  # torch seeds are 64-bit; n > 1 adds the sample index to the seed
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# Template variables that the request's own fields (or the tokenizer) set: not overridable.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


# Fields that the OpenAI, vLLM or SGLang APIs define and nanoserve does not implement, each of
# which would change the output: a 400 naming the field, whatever `--ignore-unknown-fields` says.
REFUSED_FIELDS: dict[str, str] = {
    "audio": "audio output is not supported",
    "functions": "the deprecated `functions` is not supported; send `tools`",
    "function_call": "the deprecated `function_call` is not supported; send `tool_choice`",
    "moderation": "moderation is not supported",
    "web_search_options": "web search is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "length_penalty (beam search) is not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not supported",
    "add_special_tokens": "add_special_tokens is not supported on this route",
    "documents": "documents (RAG templates) are not supported",
    "chat_template": "a request's own chat_template is not supported",
    "mm_processor_kwargs": "multimodal input is not supported",
    "logits_processors": "logits_processors are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "vllm_xargs": "vllm_xargs is not supported",
    "kv_transfer_params": "KV transfer is not supported",
    "regex": "SGLang's `regex` is not supported; send `structured_outputs.regex`",
    "ebnf": "SGLang's `ebnf` is not supported; send `structured_outputs.grammar`",
    "lora_path": "LoRA adapters are not supported",
    "session_params": "sessions are not supported",
}


class StreamOptions(NestedModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # a no-op: nanoserve's chunks carry no obfuscation padding


class ContentPart(NestedModel):
    type: str
    text: str | None = None

    def refused_as_a_whole(self) -> bool:
        return self.type != "text"  # an image, audio or file part: "only text content parts" (`to_template`)


class Prediction(NestedModel):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat."""

    type: str
    content: str | list[ContentPart]

    def text(self) -> str:
        """The predicted text; a 400 naming `prediction` unless it is content given as a string or
        as text parts (joined)."""
        if self.type != "content":
            raise APIError(400, f"prediction type must be 'content', got {self.type!r}", param="prediction")
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" or p.text is None for p in self.content):
            raise APIError(400, "prediction content parts must be text parts", param="prediction")
        return "".join(p.text or "" for p in self.content)


class FunctionDefinition(NestedModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDefinition(NestedModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(NestedModel):
    name: str


class NamedToolChoice(NestedModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    # Not a NestedModel: a message's fields beyond these go to the chat template as they are sent
    # (`to_template`), as vLLM passes them; the template reads what it knows of them.
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, object]:
        """The message as chat templates expect it: text parts joined into one string, the
        `developer` role as `system`, other fields (tool_calls, tool_call_id) passed through."""
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content: str | None = "\n".join(p.text or "" for p in self.content)
        else:
            content = self.content
        message: dict[str, object] = {**(self.model_extra or {}), "role": self.role, "content": content}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_decoded_arguments(c) for c in calls]
        if self.role == "developer":
            message["role"] = "system"
        if self.name is not None:
            message["name"] = self.name
        return message


def _decoded_arguments(call: object) -> object:
    """An assistant message's tool call with its `function.arguments` JSON text decoded: chat
    templates (Qwen's, Llama's) write the arguments with `tojson`, which would encode them twice."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(400, "each tool call of a message needs a `function` object", param="messages")
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise APIError(400, f"tool call arguments are not valid JSON: {e}", param="messages") from e
    return {**call, "function": {**call["function"], "arguments": arguments}}


class JsonSchemaFormat(NestedModel):
    """`response_format.json_schema` (OpenAI): the schema the output must validate against."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, object] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(NestedModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(NestedModel):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    json_: dict[str, object] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _constraint(param: str, **given: object) -> tuple[str, StructuredOutputs]:
    """A constraint built from one request field; a malformed one is a 400 naming the field."""
    try:
        return param, StructuredOutputs(**given)  # type: ignore[arg-type]
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _CONFIG
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-_SEED_BOUND, lt=_SEED_BOUND)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's stored completions: nanoserve stores nothing, so `store: true` is a 400 and
    # `metadata` (tags for stored completions) has nothing to tag.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prediction: Prediction | None = None  # Predicted Outputs: drafts for speculative decoding
    # SGLang's extras, which sglang-router (see `nanoserve serve --data-parallel-size`) writes into
    # every request it forwards: accepted at the values in ROUTER_DEFAULTS only, which are what
    # nanoserve does anyway; any other value is a 400 naming the field.
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None
    ROUTER_DEFAULTS: ClassVar[dict[str, bool]] = {"no_stop_trim": False, "return_hidden_states": False}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def structured(self) -> tuple[str, StructuredOutputs] | None:
        """The output constraint the request asks for, and the field that asks it: from
        `response_format` (json_object, json_schema), `structured_outputs` or a `guided_*` field.
        More than one is a 400; so is a malformed one."""
        asked: list[tuple[str, StructuredOutputs]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(_constraint("response_format", json_object=True))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format")
            asked.append(_constraint("response_format", json=fmt.json_schema.schema_))
        if (so := self.structured_outputs) is not None:
            asked.append(_constraint("structured_outputs", json=so.json_, json_object=bool(so.json_object),
                                     regex=so.regex, choice=so.choice, grammar=so.grammar))
        for param, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if (value := getattr(self, param)) is not None:
                asked.append(_constraint(param, **{key: value}))
        if len(asked) > 1:
            raise APIError(400, f"a request takes one output constraint; got {', '.join(p for p, _ in asked)}",
                           param=asked[1][0])
        return asked[0] if asked else None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters, `defaults` (the model's generation config) filling the fields
        the request leaves unset; a value out of range is a 400 naming its field."""
        if self.store:
            raise APIError(400, "store is not supported: nanoserve stores no completions", param="store")
        for name, default in self.ROUTER_DEFAULTS.items():
            if getattr(self, name) not in (None, default):
                raise APIError(400, f"{name} is supported only as {str(default).lower()}", param=name)
        given = {k: v for k, v in self.model_dump(include=set(_SAMPLING_FIELDS)).items() if v is not None}
        if self.logit_bias is not None:
            given["logit_bias"] = _token_bias(self.logit_bias)
        if self.prediction is not None:
            given["prediction"] = self.prediction.text()
        constraint = self.structured()
        if constraint is not None:
            given["structured"] = constraint[1]
        try:
            return SamplingParams(**{**(defaults or {}), **given, "max_tokens": max_tokens, "logprobs": logprobs})
        except ValueError as e:
            raise bad_request(e, _SAMPLING_FIELDS) from e


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` (token id as a string -> bias) with int keys; 400 for a key that is
    not a token id."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    # Documented no-ops of the chat API: none of them can change the output. `safety_identifier`
    # (like `user`) names the end user for abuse monitoring; `service_tier` picks a billing tier;
    # the prompt cache fields steer OpenAI's cache, where nanoserve's prefix cache is always on
    # (and the cache-aware router in front of replicas routes by the prompt's own prefix).
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, str] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    ROUTER_DEFAULTS: ClassVar[dict[str, bool]] = {**_SamplingRequest.ROUTER_DEFAULTS, "continue_final_message": False,
                                                  "separate_reasoning": True, "stream_reasoning": True}

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (e.g. `enable_thinking`): JSON values under names
        a template can read, none of them one the request sets otherwise. `reasoning_effort` sets
        `enable_thinking` (false for "none" and "minimal", as vLLM maps it onto Qwen3's switch) and
        the template's own `reasoning_effort`; `verbosity` sets `verbosity`; a template that reads
        none of them renders as without them, and `chat_template_kwargs` wins over both."""
        if self.modalities is not None and self.modalities != ["text"]:
            raise APIError(400, "only the text modality is supported", param="modalities")
        derived: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            derived["enable_thinking"] = self.reasoning_effort not in ("none", "minimal")
            derived["reasoning_effort"] = self.reasoning_effort
        if self.verbosity is not None:
            derived["verbosity"] = self.verbosity
        kwargs = {**derived, **(self.chat_template_kwargs or {})}
        for name in kwargs:
            if name in RESERVED_TEMPLATE_NAMES:
                raise APIError(400, f"chat_template_kwargs may not set `{name}`; it comes from the request",
                               param="chat_template_kwargs")
            if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
                raise APIError(400, f"chat_template_kwargs has a name a template cannot read: {name!r}",
                               param="chat_template_kwargs")
        return kwargs

    parallel_tool_calls: bool | None = None

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools to render into the prompt: None without tools or with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tools(self) -> list[FunctionDefinition] | None:
        """The functions a call must be made to: every tool for tool_choice "required", the named
        one for a named choice, None when no call is forced. A 400 when the choice names no tool
        of the request, or forces a call together with another output constraint."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        tools = [t.function for t in self.tools or []]
        if isinstance(choice, NamedToolChoice):
            tools = [f for f in tools if f.name == choice.function.name]
            if not tools:
                raise APIError(400, f"tool_choice names `{choice.function.name}`, which is not among the tools",
                               param="tool_choice")
        elif not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        if (constraint := self.structured()) is not None:
            raise APIError(400, f"a forced tool call cannot be combined with {constraint[0]}", param="tool_choice")
        return tools

    def requested_logprobs(self) -> int | None:
        """Top-k count for the engine: None without `logprobs`, else `top_logprobs` (default 0)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# What a prompt may be: a text or token ids, or a batch of those; none of them empty (`prompts`).
PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                               "items": {"type": "integer", "minimum": 0}}},
]}


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = None
    echo: bool | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request, one engine request each; empty ones are a 400."""
        p = self.prompt
        single = isinstance(p, str) or not p or isinstance(p[0], int)
        batch = cast(list[str | list[int]], [p] if single else list(p))
        if not batch or any(len(x) == 0 for x in batch):
            raise APIError(400, "the prompt is empty", param="prompt")
        if self.best_of not in (None, 1, self.n or 1):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported", param="echo")
        return batch


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: either `prompt` or `messages` (rendered with the chat template)."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: Annotated[list[int], WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": 0}})]
