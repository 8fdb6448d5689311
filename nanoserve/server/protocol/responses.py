"""Request body of the OpenAI Responses API (`POST /v1/responses`), as strict pydantic models.

The same invariants as `protocol.openai`: strict types (a wrong type is a 400 naming the field),
`null` means the default, unknown top-level fields stay in `model_extra` for `check_request` to
refuse, a nested model's (an input item's too) are refused by its validation (`NestedModel`).
Input items are told apart by `type` (a message may leave it out, as the SDK's `EasyInputMessage`
does); an item type nanoserve does not run (web search, computer use, ...) is a 400 naming the
item. Only function tools exist here.

Fields that would change the output and that nanoserve cannot honour are refused by
`ResponsesRequest.unsupported` (a 400 naming the field), apart from their documented no-op values.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, WithJsonSchema

from nanoserve.server.protocol.nested import NestedModel

_CONFIG = ConfigDict(strict=True, extra="allow")
# The one `include` value honoured: reasoning items carry their text in `encrypted_content` too, for
# clients that keep no state (`store: false`) and send reasoning back that way. It is not encrypted:
# nanoserve holds no key, and the text is in the item's `content` already.
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class TextPart(NestedModel):
    """A content part of an input message: `input_text`, or `output_text` / `refusal` in an
    assistant message sent back; images, files and audio are a 400."""

    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    # What an `output_text` part of an earlier response carries, sent back with it (the SDK's
    # `response.output` appended to the next input): the earlier turn's, changing nothing of this one.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    def plain(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(NestedModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.plain() for p in self.content)


class FunctionCallItem(NestedModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(NestedModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.plain() for p in self.output)


class ReasoningText(NestedModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(NestedModel):
    """A reasoning item of an earlier output, sent back: its text goes to the next assistant
    turn's `reasoning_content` (templates that keep past reasoning read it there)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # what nanoserve writes there: the reasoning text itself
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary) or self.encrypted_content or ""


def _item_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "message" if kind is None else str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(NestedModel):
    """A Responses function tool: flat, where chat nests the same fields under `function`."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class NamedFunctionChoice(NestedModel):
    type: Literal["function"]
    name: str


class TextFormat(NestedModel):
    """`text.format`: plain text, any JSON object, or JSON valid against `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, object] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(NestedModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(NestedModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(NestedModel):
    include_obfuscation: bool | None = None  # nanoserve never pads events: nothing to turn off


class ResponsesRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    input: list[InputItem] | str  # the list first: its errors name the item
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; nanoserve's prefix cache needs none
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # Fields of OpenAI's whose other values are refused (`unsupported`): their schemas list the values taken.
    truncation: Annotated[Literal["auto", "disabled"] | None, WithJsonSchema({"enum": ["disabled", None]})] = None
    include: Annotated[list[str] | None, WithJsonSchema(
        {"anyOf": [{"type": "array", "items": {"const": ENCRYPTED_REASONING}}, {"type": "null"}]})] = None
    background: Annotated[bool | None, WithJsonSchema({"enum": [False, None]})] = None
    max_tool_calls: Annotated[int | None, WithJsonSchema({"type": "null"})] = None
    top_logprobs: Annotated[int | None, WithJsonSchema({"enum": [0, None]})] = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to a value nanoserve cannot honour, else None."""
        if self.truncation == "auto":
            return "truncation", "truncation 'auto' is not supported: an input too long for the context is a 400"
        if unknown := [v for v in self.include or [] if v != ENCRYPTED_REASONING]:
            return "include", f"include values other than {ENCRYPTED_REASONING} are not supported: {', '.join(unknown)}"
        if self.background:
            return "background", "background responses are not supported"
        if self.max_tool_calls is not None:
            return "max_tool_calls", "max_tool_calls is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported by /v1/responses"
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            return "text.verbosity", "text.verbosity other than 'medium' is not supported"
        reasoning = self.reasoning
        if reasoning is not None and ((reasoning.summary or "auto") != "auto"
                                      or (reasoning.generate_summary or "auto") != "auto"):
            return "reasoning.summary", ("reasoning summaries are not written: reasoning comes as reasoning_text; "
                                         "reasoning.summary may only be 'auto'")
        return None
