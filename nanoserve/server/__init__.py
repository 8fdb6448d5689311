"""The OpenAI-compatible HTTP server: the FastAPI app and its routes (`app`, `serving*`), the wire
(`protocol/`), chat output parsing (`chat/`), the browser pages (`web/`), uvicorn (`http_server`).

The names below are imported on first use (PEP 562), so importing a light module of the package
(`defaults`, the parser registries, for the CLI's parser) does not load the app (nor torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.server.app import ServerConfig, build_app
    from nanoserve.server.defaults import DEFAULT_MAX_QUEUED_REQUESTS, DEMO_MODEL_NAME

__all__ = ["DEFAULT_MAX_QUEUED_REQUESTS", "DEMO_MODEL_NAME", "ServerConfig", "build_app"]

_EXPORTS = {"DEFAULT_MAX_QUEUED_REQUESTS": "defaults", "DEMO_MODEL_NAME": "defaults", "ServerConfig": "app",
            "build_app": "app"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
