"""Model configs, the decoder (`families/` declares each family), weight formats and block
quantization (`quant/`), checkpoints in and out (`checkpoint/`) and the demo model (`demo/`)."""

from nanoserve.model.checkpoint.loader import LoadedModel, load_model
from nanoserve.model.config import ModelConfig, ModelLoadError, UnsupportedModelError
from nanoserve.model.decoder import CausalLM

__all__ = ["CausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "UnsupportedModelError", "load_model"]
