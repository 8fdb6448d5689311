"""Request bodies of the OpenAI API (and vLLM's extras), as strict pydantic models.

Invariants: types are checked strictly (a string is never coerced to a number), so a wrong type is
a 400 naming the field; every field is optional where the SDK may send `null`, and `null` means
the default; unknown fields are kept in `model_extra`, where the handler refuses them (a 400
naming the field: see `Serving.check_request`). Ranges are checked once, by
`SamplingParams.validate`, when `sampling_params` builds the engine's params.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.server.errors import APIError, bad_request

_CONFIG = ConfigDict(strict=True, extra="allow")
_SEED_BOUND = 2**63  # torch seeds are 64-bit; n > 1 adds the sample index to the seed
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool | None = None


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
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
    # OpenAI's stored completions: nanoserve stores nothing, so `store: true` is a 400 and
    # `metadata` (tags for stored completions) has nothing to tag.
    store: bool | None = None
    metadata: dict[str, str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters, `defaults` (the model's generation config) filling the fields
        the request leaves unset; a value out of range is a 400 naming its field."""
        if self.store:
            raise APIError(400, "store is not supported: nanoserve stores no completions", param="store")
        given = {k: v for k, v in self.model_dump(include=set(_SAMPLING_FIELDS)).items() if v is not None}
        if self.logit_bias is not None:
            given["logit_bias"] = _token_bias(self.logit_bias)
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

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools to render into the prompt: None without tools or with tool_choice "none".
        "required" and a named function would need constrained decoding, which nanoserve lacks."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice not in (None, "auto"):
            raise APIError(400, "only tool_choice 'auto' and 'none' are supported (forcing a call needs constrained "
                           "decoding)", param="tool_choice")
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def requested_logprobs(self) -> int | None:
        """Top-k count for the engine: None without `logprobs`, else `top_logprobs` (default 0)."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
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

    model_config = _CONFIG
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    tokens: list[int]
