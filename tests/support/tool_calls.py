"""The one tool call the tool-calling checkpoints write, its tokens, and the tool it calls."""

from __future__ import annotations

import json

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_TEXT = json.dumps(CALL)
CALL_PIECES = ['{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}']  # tokens of the model
assert "".join(CALL_PIECES) == CALL_TEXT
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
