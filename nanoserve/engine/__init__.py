"""Request state, scheduler, model runner, sampler and the engine loop."""

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm import LLM, CompletionOutput, RequestOutput
from nanoserve.engine.llm_engine import LLMEngine, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "SequenceDelta"]
