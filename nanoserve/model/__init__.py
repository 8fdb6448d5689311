"""Model configs, the decoder, weight loading (safetensors and GGUF) and the demo model."""

from nanoserve.model.config import ModelConfig, UnsupportedModelError
from nanoserve.model.decoder import CausalLM
from nanoserve.model.loader import LoadedModel, ModelLoadError, load_model

__all__ = ["CausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "UnsupportedModelError", "load_model"]
