"""The OpenAI-compatible HTTP server: FastAPI app, engine thread, protocol, SSE, metrics, auth."""

from nanoserve.server.app import DEFAULT_MAX_QUEUED_REQUESTS, DEMO_MODEL_NAME, ServerConfig, build_app

__all__ = ["DEFAULT_MAX_QUEUED_REQUESTS", "DEMO_MODEL_NAME", "ServerConfig", "build_app"]
