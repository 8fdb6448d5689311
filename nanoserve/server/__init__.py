"""The OpenAI-compatible HTTP server: the FastAPI app and its routes (`app`, `serving*`), the wire
(`protocol/`), chat output parsing (`chat/`), the browser pages (`web/`), uvicorn (`http_server`)."""

from nanoserve.server.app import DEFAULT_MAX_QUEUED_REQUESTS, DEMO_MODEL_NAME, ServerConfig, build_app

__all__ = ["DEFAULT_MAX_QUEUED_REQUESTS", "DEMO_MODEL_NAME", "ServerConfig", "build_app"]
