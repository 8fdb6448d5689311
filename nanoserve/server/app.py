"""The FastAPI app: OpenAI routes, the Anthropic Messages routes, /health, /metrics, /tokenize,
/detokenize, /server_info, auth and errors.

`build_app` is the only way to get an app; everything the routes share (the engine core's front
end, metrics registry, model name) lives in the app it builds, never at module level. The engine
core (a thread or a process) starts and stops with the app's lifespan; `app.state.engine` is the
`AsyncEngine` (tests read its `snapshot` to check that the KV pool is free again).

The POST routes read their bodies themselves (`_parse`: JSON whatever the Content-Type, strict
types, 400s in the route's error shape); `/openapi.json` still documents each body, by its pydantic model,
and every status and content type each route answers (`openapi.document`).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.defaults import DEFAULT_MAX_RESTARTS
from nanoserve.runtime.engine_core import EngineInfo, EngineState
from nanoserve.runtime.metrics import Metrics
from nanoserve.server.body_limit import BodyLimit
from nanoserve.server.chat.reasoning_parsers import REASONING_PARSERS
from nanoserve.server.chat.tool_parsers.registry import TOOL_PARSERS
from nanoserve.server.defaults import (
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_PROMPT_WORKERS,
    DEMO_MODEL_NAME,
)
from nanoserve.server.openapi import document
from nanoserve.server.protocol.anthropic import CountTokensRequest, MessagesRequest
from nanoserve.server.protocol.embeddings import EmbeddingRequest
from nanoserve.server.protocol.errors import APIError, install_error_handlers, invalid_request
from nanoserve.server.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.server.protocol.responses import ResponsesRequest
from nanoserve.server.response_store import DEFAULT_RESPONSES_STORE_SIZE, ResponseStore
from nanoserve.server.serving import PromptGate, Serving, now_s
from nanoserve.server.serving_chat import create_chat_completion
from nanoserve.server.serving_completion import create_completion
from nanoserve.server.serving_embeddings import create_embedding
from nanoserve.server.serving_messages import count_tokens, create_message
from nanoserve.server.serving_responses import create_response, delete_response, get_response, list_input_items
from nanoserve.server.web.dashboard import register_dashboard
from nanoserve.server.web.pages import register_pages
from nanoserve.tokenizer.prompt_limits import DEFAULT_TIMEOUT_S, PromptLimits


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """`served_model_name` defaults to the engine's model argument (DEMO_MODEL_NAME for the demo
    model); `api_key`, when set, guards /v1/*, /tokenize, /detokenize and /dashboard/stats. `allowed_origins`:
    the origins browsers may call from (CORS; empty: no CORS headers, "*": any).
    `sse_keep_alive_s`: a silent stream's keep-alive comment interval (None: never).
    `prompt_workers`, `prompt_timeout_s`: the processes that render chat templates and tokenize, and
    how long one request's text may take there (see `serving.PromptGate`).
    `responses_store_size`: how many `store: true` responses /v1/responses keeps (0: none)."""

    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    tool_call_parser: str = "auto"  # a name of TOOL_PARSERS: auto (from the chat template), a format, or none
    stream_interval: int = 1  # steps between a request's outputs (see AsyncEngine)
    reasoning_parser: str = "auto"  # a name of REASONING_PARSERS: auto, a format, or none
    allowed_origins: tuple[str, ...] = ()
    sse_keep_alive_s: float | None = DEFAULT_KEEP_ALIVE_S
    prompt_workers: int = DEFAULT_PROMPT_WORKERS
    prompt_timeout_s: float = DEFAULT_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is a 413, never parsed
    engine_restarts: int = DEFAULT_MAX_RESTARTS  # restarts of a dead engine-core process within 10 minutes
    ignore_unknown_fields: bool = False  # log and drop request fields no API defines (else a 400)
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE

    def __post_init__(self) -> None:
        if self.prompt_workers < 1 or self.prompt_timeout_s <= 0:
            raise ValueError("prompt workers must be at least one and their timeout positive")
        if self.sse_keep_alive_s is not None and self.sse_keep_alive_s <= 0:
            raise ValueError("the SSE keep-alive interval must be positive (None: no keep-alive)")
        if self.responses_store_size < 0:
            raise ValueError("the responses store size must be >= 0 (0: store none)")
        TOOL_PARSERS.check(self.tool_call_parser)
        REASONING_PARSERS.check(self.reasoning_parser)


def build_app(engine: LLMEngine | Callable[[], LLMEngine] | EngineArgs, config: ServerConfig | None = None,
              on_fatal: Callable[[], None] | None = None,
              on_ready: Callable[[EngineInfo], None] | None = None) -> FastAPI:
    """An app serving `engine`: a built engine or a loader, served from a thread of this process,
    or `EngineArgs`, built and served in an engine-core process. A loader or `EngineArgs` load
    at startup (/health answers 503 until the model is ready); a dead engine-core process is
    restarted up to `config.engine_restarts` times (see AsyncEngine), and `on_fatal` is called when
    the engine will not serve again (it never loaded, or died past its restarts); `on_ready` each
    time the engine starts serving (once loaded, and after each restart)."""
    config = config or ServerConfig()
    if isinstance(engine, LLMEngine):
        loader: Callable[[], LLMEngine] | EngineArgs = _ready(engine)
        name = config.served_model_name or engine.args.model or DEMO_MODEL_NAME
    elif isinstance(engine, EngineArgs):
        loader, name = engine, config.served_model_name or engine.model or DEMO_MODEL_NAME
    else:
        loader, name = engine, config.served_model_name or DEMO_MODEL_NAME
    metrics = Metrics(name)
    async_engine = AsyncEngine(loader, max_queued_requests=config.max_queued_requests, metrics=metrics,
                               stream_interval=config.stream_interval, max_restarts=config.engine_restarts,
                               on_fatal=on_fatal, on_ready=on_ready)
    prompts = PromptGate(config.prompt_workers, PromptLimits(timeout_s=config.prompt_timeout_s))
    serving = Serving(async_engine, name, config.tool_call_parser, config.reasoning_parser, prompts=prompts,
                      keep_alive_s=config.sse_keep_alive_s, ignore_unknown_fields=config.ignore_unknown_fields)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            serving.prompts.close()
            await async_engine.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.engine = async_engine
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyAuth, api_key=config.api_key)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:  # added last, so it runs first: preflights never meet the key check
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    _add_routes(app, serving, metrics)
    _add_responses_routes(app, serving, ResponseStore(config.responses_store_size))
    register_pages(app)
    document(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                   "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
                   "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest,
                   "/v1/responses": ResponsesRequest},
             model_name=name, ignore_unknown_fields=config.ignore_unknown_fields,
             guarded=_guarded if config.api_key else None)
    register_dashboard(app, async_engine)
    return app


def _ready(engine: LLMEngine) -> Callable[[], LLMEngine]:
    return lambda: engine


def _add_routes(app: FastAPI, serving: Serving, metrics: Metrics) -> None:
    created = now_s()

    def model_card() -> dict[str, Any]:
        card: dict[str, Any] = {"id": serving.model_name, "object": "model", "created": created,
                                "owned_by": "nanoserve"}
        if serving.engine.info is not None:
            card["max_model_len"] = serving.engine.info.limits.max_model_len
        return card

    @app.get("/health")
    async def health() -> JSONResponse:
        if serving.engine.state is not EngineState.RUNNING:
            state = serving.engine.state.value
            raise APIError(503, serving.engine.unavailable_reason(), code=f"engine_{state}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        """SGLang's server metadata, from which sglang-router learns the served model's name. No
        `model_path`: the router would try to fetch a tokenizer from it (a hub download)."""
        return JSONResponse({"served_model_name": serving.model_name, "is_generation": True})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id != serving.model_name:
            raise APIError(404, f"the model `{model_id}` does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(serving, await _parse(request, ChatCompletionRequest), request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(serving, await _parse(request, CompletionRequest), request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(serving, await _parse(request, MessagesRequest), request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        return await count_tokens(serving, await _parse(request, CountTokensRequest))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(serving, await _parse(request, EmbeddingRequest), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _parse(request, TokenizeRequest)
        serving.check_request(body, body.model)
        info, tok = serving.running_info(), serving.tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = await serving.prompts.encode_chat(tok, info.limits, [m.to_template() for m in body.messages],
                                                    add_generation_prompt=body.add_generation_prompt is not False)
        else:
            ids = await serving.prompts.encode(tok, info.limits, body.prompt or "", "prompt",
                                               body.add_special_tokens is not False)
        return JSONResponse({"count": len(ids), "max_model_len": info.limits.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = await _parse(request, DetokenizeRequest)
        serving.check_request(body, body.model)
        tok = serving.tokenizer()
        if any(not 0 <= t < tok.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {tok.vocab_size})", param="tokens")
        return JSONResponse({"prompt": tok.decode(body.tokens)})


def _add_responses_routes(app: FastAPI, serving: Serving, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(serving, store, await _parse(request, ResponsesRequest), request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        return get_response(store, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request) -> JSONResponse:
        return list_input_items(store, response_id, dict(request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> JSONResponse:
        return delete_response(store, response_id)


_Body = TypeVar("_Body", bound=BaseModel)


async def _parse(request: Request, model: type[_Body]) -> _Body:
    """The body as `model`, read as JSON whatever the Content-Type says (so a bare `curl -d`
    works); a 400 naming the first bad field otherwise."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_request(e.errors(), _json(raw)) from e


def _json(raw: bytes) -> Any:
    """`raw` as JSON, None if it is not JSON (or nested too deep to read)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


class APIKeyAuth:
    """ASGI middleware: the API key, as `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
    (Anthropic's header), on /v1/*, /tokenize, /detokenize and /dashboard/stats; both headers are
    compared in constant time, every time. /health, /metrics, the docs and the pages' static files
    stay open. A 401 takes the error shape of the route asked for."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(scope["path"]):
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self._bearer)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)
            if not (bearer | key):
                error = APIError(401, "invalid or missing API key: send `Authorization: Bearer <key>` or "
                                 "`x-api-key: <key>`", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _guarded(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/dashboard/stats")
