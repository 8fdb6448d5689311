"""nanoserve: a compact, OpenAI-compatible LLM inference server on PyTorch."""

from nanoserve.engine import EngineArgs, SamplingParams
from nanoserve.runtime import LLM

__all__ = ["LLM", "EngineArgs", "SamplingParams"]
__version__ = "0.1.0"
