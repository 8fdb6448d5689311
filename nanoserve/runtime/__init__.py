"""The engine at run time: built from `EngineArgs` with the runner the arguments choose
(`builder`), driven offline (`llm.LLM`) or behind the HTTP server, in an engine-core process or
thread (`engine_core`) with its front end (`async_engine`, `deltas`, `metrics`).

The names below are imported on first use (PEP 562), so importing a light module of the package
(`defaults`, for the CLI's parser) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.runtime.builder import build_engine
    from nanoserve.runtime.llm import LLM

__all__ = ["LLM", "build_engine"]

_EXPORTS = {"LLM": "llm", "build_engine": "builder"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
