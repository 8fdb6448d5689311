"""Forced tool calls (`tool_choice` "required" or a named function) as a grammar over the
tool-call format the model's parser reads (`tool_parsers`), so the output is always a call the
parser accepts, to one of the allowed functions, with arguments valid against its parameters.
The parser's class says how its format writes a call (`forced_format`); a format that says
nothing cannot force one.

A model whose template shows no format (no parser) is forced to write the calls as a JSON array
of `{"name", "arguments"}` objects instead (`forced_json_calls`, read by `JsonListParser`).

With `parallel_tool_calls` false the grammar takes exactly one call; otherwise one or more.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.engine.sampling_params import StructuredOutputs
from nanoserve.engine.structured import json_schema_source
from nanoserve.server.chat.tool_parsers.calls import ToolCallParser
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.openai import FunctionDefinition
from nanoserve.tokenizer import Tokenizer


def _literal(text: str, tok: Tokenizer) -> str:
    """`text` as a Lark terminal: a marker that is one token of the vocabulary (Qwen's
    `<tool_call>` is an added token) is matched as that token (`<[id]>`), as the model writes it;
    other text as a string."""
    token_id = tok.backend.token_to_id(text)
    return f"<[{token_id}]>" if token_id is not None and len(text) > 1 else json.dumps(text)


def call_schema(functions: list[FunctionDefinition], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call to any of `functions`: its name, and arguments valid against
    that function's parameters (any object where it declares none)."""
    def one(f: FunctionDefinition) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": f.name},
                                                 arguments_key: f.parameters or {"type": "object"}},
                "required": ["name", arguments_key], "additionalProperties": False}

    options = [one(f) for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_tool_calls(parser: type[ToolCallParser], functions: list[FunctionDefinition],
                      parallel: bool, tok: Tokenizer) -> StructuredOutputs:
    """The grammar (Lark, llguidance's dialect, with the call as an embedded JSON schema) of a
    message of forced calls in `parser`'s format; a 400 for a parser with no such grammar."""
    fmt = parser.forced_format
    if fmt is None:
        raise APIError(400, "forcing a tool call is not supported with this model's tool-call parser",
                       param="tool_choice")
    schema = json.dumps(json_schema_source(call_schema(functions, fmt.arguments_key)))
    calls = f"call ({json.dumps(fmt.between)} call)*" if parallel else "call"
    call = " ".join("body" if p is None else _literal(p, tok) for p in fmt.pieces)
    return StructuredOutputs(grammar=f"start: {calls}\ncall: {call}\nbody: %json {schema}\n")


def forced_json_calls(functions: list[FunctionDefinition], parallel: bool) -> StructuredOutputs:
    """The JSON schema of a message of forced calls on a model with no tool-call format: an array
    of one call (`parallel` false) or one or more, each valid against `call_schema`."""
    array: dict[str, Any] = {"type": "array", "items": call_schema(functions, "arguments"), "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutputs(json=array)
