"""The engine at run time: built from `EngineArgs` with the runner the arguments choose
(`builder`), driven offline (`llm.LLM`) or behind the HTTP server, in an engine-core process or
thread (`engine_core`) with its front end (`async_engine`, `deltas`, `metrics`)."""

from nanoserve.runtime.builder import build_engine
from nanoserve.runtime.llm import LLM

__all__ = ["LLM", "build_engine"]
