"""Error bodies: OpenAI's `{"error": {"message", "type", "param", "code"}}` for every failure, except
on the Anthropic Messages routes (`/v1/messages` and below, `anthropic_route`), which answer in
Anthropic's `{"type": "error", "error": {"type", "message"}}`.

Handlers raise `APIError`; the handlers installed by `install_error_handlers` turn it, pydantic
validation errors (400, with the offending field as `param`), routing errors (404, 405) and
unexpected exceptions (500) into the shape of the route the request was for.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match, Route

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"
# The `code` of a 400 for a request field nanoserve does not implement, and the pydantic error type
# a nested model raises for one (`nested.NestedModel`), whose `ctx["field"]` names it.
UNSUPPORTED_FIELD = "unsupported_field"


def error_type(status: int) -> str:
    """The OpenAI `type` for an HTTP status."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def anthropic_route(path: str) -> bool:
    """Whether `path` is one of the Anthropic Messages routes, whose errors take Anthropic's shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body; its `type` follows the status as Anthropic's API sets it."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """A request failed with `status`; `param` names the offending request field, if any."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, path: str = "") -> dict[str, Any]:
        """The error body in the shape of the route at `path` (OpenAI's unless `anthropic_route`)."""
        if anthropic_route(path):
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def bad_request(error: ValueError, fields: frozenset[str] = frozenset()) -> APIError:
    """A 400 from a ValueError whose message starts with the field it names (SamplingParams and
    engine validation write them so); `param` is that field when it is one of `fields`."""
    message = str(error)
    first = message.split(" ", 1)[0]
    return APIError(400, message, param=first if first in fields else None)


def _param(loc: tuple[int | str, ...], body: Any = None) -> str | None:
    """`messages.0.content` from pydantic's ('body', 'messages', 0, 'content', 'str'); a leading
    'body' and union-member tags such as 'str' or 'list[int]' are dropped. Given the `body` sent,
    the path is one that can be followed in it: a name that is not a key there on the way (a
    tagged union's tag, such as a content block's 'text') is dropped too."""
    loc = loc[1:] if loc[:1] == ("body",) else loc
    followed = None if body is None else _follow(body, loc)
    if followed is None:
        followed = [str(p) for p in loc if isinstance(p, int) or (p.isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(followed) or None


def _follow(here: Any, loc: tuple[int | str, ...]) -> list[str] | None:
    """The elements of `loc` that are keys and indices of `here`, in order; the last one may be a
    field not sent. A name that is not one of them is skipped (a tag, a union member's name), but
    a last name under a value that is not an object makes the path fail (None): so a tag that is
    also a key (a text block's 'text') is taken for a key only where the rest follows."""
    if not loc:
        return []
    p, rest = loc[0], loc[1:]
    if isinstance(here, list) and isinstance(p, int):
        sub = _follow(here[p], rest) if 0 <= p < len(here) else None
        return None if sub is None else [str(p), *sub]
    if isinstance(here, dict) and isinstance(p, str):
        if p in here and (sub := _follow(here[p], rest)) is not None:
            return [p, *sub]
        if not rest and p.isidentifier() and p not in _TYPE_TAGS:
            return [p]  # a field not sent
    if isinstance(p, str) and (rest or not p.isidentifier() or p in _TYPE_TAGS):
        return _follow(here, rest)
    return None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _where(error: Any, body: Any = None) -> str | None:
    """The path of the field a pydantic error is about; for an unknown field of a nested model,
    the path of that field (its model's path and its name)."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == UNSUPPORTED_FIELD:
        loc = (*loc, str(error["ctx"]["field"]))
    return _param(loc, body)


def invalid_request(errors: list[Any], body: Any = None) -> APIError:
    """A 400 from pydantic errors about `body` (the JSON sent, where known); `param` is the first
    field nanoserve does not implement (code `unsupported_field`), else the first offending field."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return APIError(400, "the request body is not valid JSON")
    # An unknown field is named before the other members of a union that failed for it.
    first = next((e for e in errors if e.get("type") == UNSUPPORTED_FIELD), errors[0] if errors else None)
    param = _where(first, body) if first is not None else None
    code = UNSUPPORTED_FIELD if first is not None and first.get("type") == UNSUPPORTED_FIELD else None
    shown = sorted({f"{_where(e, body) or 'body'}: {e.get('msg')}" for e in errors})
    return APIError(400, "invalid request: " + "; ".join(shown[:5]), param=param, code=code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return invalid_request(list(exc.errors())).response(request.url.path)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    message = f"no route {request.method} {request.url.path}" if status in (404, 405) else str(exc.detail)
    headers = dict(exc.headers) if exc.headers else None
    if status == 405:  # every method of the path, not only the first route's that matched it
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    error = APIError(status, message, code="not_found" if status == 404 else None, headers=headers)
    return error.response(request.url.path)


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches the request's."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}").response(request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
