"""Request state, scheduler, model runner, sampler and the engine loop."""

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.builder import build_engine
from nanoserve.engine.llm import LLM
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, StepOutput
from nanoserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "SequenceDelta",
           "StepOutput", "build_engine"]
