"""nanoserve: a compact, OpenAI-compatible LLM inference server on PyTorch.

`LLM`, `EngineArgs` and `SamplingParams` are imported on first use, so importing a light part of
the package (the tokenizer in a worker process, the CLI's argument parser) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.engine import EngineArgs, SamplingParams
    from nanoserve.runtime import LLM

__all__ = ["LLM", "EngineArgs", "SamplingParams"]
__version__ = "0.1.0"

_EXPORTS = {"LLM": "nanoserve.runtime", "EngineArgs": "nanoserve.engine", "SamplingParams": "nanoserve.engine"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
