"""/openapi.json as the server behaves: every route's request body, the statuses it can answer and
the content types of its answers.

The POST routes read their bodies themselves (`app._parse`), so FastAPI cannot see them;
`document` describes each by its pydantic model. What the models alone would get wrong is
corrected here, so that a client (or a fuzzer such as schemathesis) that trusts the description
meets no surprise:

- the model: a body's `model` may only name the served model (any other is a 404);
- unknown fields: a request body's unknown fields are a 400 unless sent as null
  (`Serving.check_request`), so its schema allows further properties only as null (any value
  with `--ignore-unknown-fields`, which drops them); nested models say the same by their own
  config (`json_schema_extra`: `protocol.nested.NestedModel`, which refuses them whatever the flag);
- statuses: besides 200, every operation lists each error it can answer, in its route's shape
  (Anthropic's on `/v1/messages*`): 400, 404 (an unknown model or stored response), 413 (a body
  over the limit), 429 (a full queue, on the routes that queue), 401 (with an API key) and 503
  (the engine is not running, or too many connections); FastAPI's 422 never happens (validation
  errors are 400s) and is not listed;
- content types: the generation routes answer `text/event-stream` when asked to stream, and
  /metrics Prometheus or OpenMetrics text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from nanoserve.server.protocol.errors import anthropic_route

# Routes whose answer streams as server-sent events when the body asks for it.
STREAMING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
# Routes that queue work in the engine (a full queue is a 429).
QUEUED_ROUTES = STREAMING_ROUTES | {"/v1/embeddings"}
# Routes that name a stored response (404 when there is none).
_STORED = "/v1/responses/{response_id}"

_OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_WHY = {
    400: "an invalid request (`error.param` names the field)",
    401: "a missing or wrong API key",
    404: "the model, or the stored response, does not exist",
    413: "the body is larger than the server's limit",
    429: "the queue is full (see Retry-After)",
    503: "the engine is loading, restarting or stopped, or the server has as many connections open as it "
         "takes (see Retry-After)",
}
# One server-sent event of a stream: its `data` is a JSON object (or `[DONE]` on the OpenAI routes).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"},
                                                                    "data": {"type": "string"}}}
_METRICS_TYPES = ("text/plain", "application/openmetrics-text")


def _body_schema_generator(bodies: frozenset[type[BaseModel]], lenient: bool,
                           model_name: str) -> type[GenerateJsonSchema]:
    """A schema generator that writes what request bodies accept besides their fields, and that
    their `model` can only be the served model's name (any other is a 404)."""

    class BodySchemas(GenerateJsonSchema):
        top: ClassVar[frozenset[type[BaseModel]]] = bodies

        def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
            json_schema = super().model_schema(schema)
            if schema["cls"] in self.top:
                json_schema["additionalProperties"] = True if lenient else {"type": "null"}
                properties = json_schema.get("properties", {})
                if "model" in properties:
                    required = "model" in json_schema.get("required", ())
                    properties["model"] = {"enum": [model_name] if required else [model_name, None],
                                           "description": "the served model's name"}
            return json_schema

    return BodySchemas


def document(app: FastAPI, bodies: dict[str, type[BaseModel]], *, model_name: str, ignore_unknown_fields: bool,
             guarded: Callable[[str], bool] | None) -> None:
    """Makes `app.openapi()` describe the app as it behaves (see the module's docstring). `bodies`:
    each POST route's body model; `model_name`: the one model served; `guarded(path)`: whether a
    route needs the API key (None: no key)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            generator = _body_schema_generator(frozenset(bodies.values()), ignore_unknown_fields, model_name)
            refs, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                            ref_template="#/components/schemas/{model}", schema_generator=generator)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            schemas.update(defs.get("$defs", {}))
            schemas["ErrorResponse"] = _OPENAI_ERROR
            schemas["AnthropicErrorResponse"] = _ANTHROPIC_ERROR
            for path, methods in spec["paths"].items():
                for method, operation in methods.items():
                    _describe(path, method, operation, bodies, refs, guarded)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe(path: str, method: str, operation: dict[str, Any], bodies: dict[str, type[BaseModel]],
              refs: dict[Any, Any], guarded: Callable[[str], bool] | None) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    responses.pop("422", None)
    statuses = [503]
    if path in bodies:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(bodies[path], "validation")]}}}
        statuses += [400, 404, 413]
    if path in QUEUED_ROUTES:
        statuses.append(429)
    if path == "/v1/models/{model_id}" or path.startswith(_STORED):
        statuses.append(404)
    if path == _STORED + "/input_items":
        statuses.append(400)
    if guarded is not None and guarded(path):
        statuses.append(401)
    for status in sorted(set(statuses)):
        responses[str(status)] = _error(path, _WHY[status])
    ok = responses.setdefault("200", {"description": "OK"})
    if path in STREAMING_ROUTES:
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _SSE_EVENT}
    if path == "/metrics" and method == "get":
        ok["content"] = _text_content(_METRICS_TYPES)


def _error(path: str, description: str) -> dict[str, Any]:
    name = "AnthropicErrorResponse" if anthropic_route(path) else "ErrorResponse"
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _text_content(types: Iterable[str]) -> dict[str, Any]:
    return {t: {"schema": {"type": "string"}} for t in types}
