"""Request bodies of the Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as
strict pydantic models, and their translation into the chat completion request that runs them.

Invariants: as in `openai`, types are strict, `null` means unset and unknown fields are kept in
`model_extra`, where the handler refuses them (a 400 naming the field; in a nested part, such as a
block or a tool, its validation does: `NestedModel`). Content blocks are told
apart by their `type`; a block nanoserve does not take (image, document, redacted_thinking, a
server tool) is a 400 naming where it is. `cache_control` is taken wherever Anthropic takes it and
asks for nothing more: the prefix cache reuses every cached prefix unasked.

The translation (`to_chat`): `system` becomes a system message; a user turn's text blocks a user
message and each `tool_result` a tool message (an `is_error` result's text is written after
"Error: "); an assistant turn's text, `tool_use` blocks and `thinking` blocks one assistant message
with `content`, `tool_calls` and `reasoning_content`; `tools` become function tools and
`tool_choice` auto / any / tool / none the chat's auto / required / named / none.
`stop_sequences` are stop strings kept in the text (`include_stop_str_in_output`), so the handler
can say which one ended the reply (`stop_sequence`) and cut it off; `output_config.format` (a JSON
schema) is the chat's `response_format` of type json_schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.nested import NestedModel
from nanoserve.server.protocol.openai import ChatCompletionRequest

_CONFIG = ConfigDict(strict=True, extra="allow")


class TextBlock(NestedModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, object] | None = None


class ToolUseBlock(NestedModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, object]
    cache_control: dict[str, object] | None = None


class ToolResultBlock(NestedModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, object] | None = None


class ThinkingBlock(NestedModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(NestedModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(NestedModel):
    """A client tool (Anthropic's server tools have other `type`s: a 400)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, object]
    type: Literal["custom"] | None = None
    cache_control: dict[str, object] | None = None


class ToolChoice(NestedModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(NestedModel):
    """`enabled` and `disabled` switch the chat template's `enable_thinking` (where the template
    reads it); `adaptive` leaves the template's default. `budget_tokens` is taken, as Anthropic
    describes it, as a target: the reply's thinking is bounded by `max_tokens` only."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized"] | None = None


class JSONOutputFormat(NestedModel):
    type: Literal["json_schema"]
    schema_: dict[str, object] = Field(alias="schema")


class OutputConfig(NestedModel):
    """`output_config`: `format` constrains the reply's text to a JSON schema (the chat's
    `response_format` of type json_schema); `effort` has no counterpart here (a 400 when set)."""

    format: JSONOutputFormat | None = None
    effort: None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what the prompt of a `MessagesRequest` is made of."""

    model_config = _CONFIG
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def to_chat(self, template_kwargs: dict[str, Any], **sampling: Any) -> ChatCompletionRequest:
        """The chat completion request of this prompt, with the template variables the handler
        derived from `thinking` and the chat's `sampling` fields (unset ones left out)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages(), **sampling}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in self.tools]
        if (choice := self.tool_choice) is not None:
            fields.update(self._tool_choice(choice))
        if template_kwargs:
            fields["chat_template_kwargs"] = template_kwargs
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    def thinking_kwargs(self, template_reads_it: bool, model_thinks: bool) -> dict[str, Any]:
        """The template variables `thinking` asks for: `enable_thinking` where the chat template
        reads it. A model that thinks by itself (a reasoning parser applies) but whose template
        cannot switch it off gets a 400 for `disabled`."""
        kind = self.thinking.type if self.thinking is not None else "adaptive"
        if kind == "adaptive":
            return {}
        if template_reads_it:
            return {"enable_thinking": kind == "enabled"}
        if kind == "disabled" and model_thinks:
            raise APIError(400, "thinking: this model's chat template cannot switch thinking off", param="thinking")
        return {}

    def _tool_choice(self, choice: ToolChoice) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if choice.type == "tool":
            if choice.name is None:
                raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            if choice.name is not None:
                raise APIError(400, f"tool_choice of type {choice.type} takes no name", param="tool_choice.name")
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        return fields

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            blocks: list[Any] = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            out.extend(_assistant_turn(blocks, i) if m.role == "assistant" else _user_turn(blocks, i))
        if self.messages[-1].role == "assistant":
            raise APIError(400, "the last message is the assistant's: continuing a prefilled reply is not supported",
                           param=f"messages.{len(self.messages) - 1}")
        return out


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, str | None] | None = None  # `user_id`, an opaque tag: changes no output
    output_config: OutputConfig | None = None

    def to_chat_request(self, template_kwargs: dict[str, Any]) -> ChatCompletionRequest:
        stop = self.stop_sequences or None
        fmt = self.output_config.format if self.output_config is not None else None
        response_format = None if fmt is None else {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}
        return self.to_chat(template_kwargs, max_tokens=self.max_tokens, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, stop=stop,
                            include_stop_str_in_output=True if stop else None, response_format=response_format)


def _user_turn(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    """A user turn's messages: its tool results as tool messages, its text as user messages, in
    the order of the blocks."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            content = b.content if isinstance(b.content, str) else "\n".join(t.text for t in b.content or [])
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {content}" if b.is_error else content})
        else:
            raise APIError(400, f"a user message cannot hold a {b.type} block", param=f"messages.{i}.content.{j}")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[Any], i: int) -> list[dict[str, Any]]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        else:
            raise APIError(400, f"an assistant message cannot hold a {b.type} block",
                           param=f"messages.{i}.content.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return [message]
