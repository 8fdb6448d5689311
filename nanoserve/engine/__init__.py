"""Request state, scheduler, model runner, sampler and the engine loop (`LLMEngine`). The engine is
handed its runner; how one is built (`nanoserve.runtime.builder`) lives above it.

The names below are imported on first use (PEP 562), so importing a light module of the package
(`engine.args` for the CLI's parser) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.engine.args import EngineArgs
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, StepOutput
    from nanoserve.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "SequenceDelta",
           "StepOutput"]

_EXPORTS = {"EngineArgs": "args", "LLMEngine": "llm_engine", "CompletionOutput": "outputs",
            "RequestOutput": "outputs", "SequenceDelta": "outputs", "StepOutput": "outputs",
            "SamplingParams": "sampling_params"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
