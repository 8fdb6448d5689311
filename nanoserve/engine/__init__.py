"""Request state, scheduler, model runner, sampler and the engine loop (`LLMEngine`). The engine is
handed its runner; how one is built (`nanoserve.runtime.builder`) lives above it."""

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import CompletionOutput, RequestOutput, SequenceDelta, StepOutput
from nanoserve.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams", "SequenceDelta",
           "StepOutput"]
