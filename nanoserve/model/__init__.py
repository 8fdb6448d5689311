"""Model configs, the decoder (`families/` declares each family), weight formats and block
quantization (`quant/`), checkpoints in and out (`checkpoint/`) and the demo model (`demo/`).

The names below are imported on first use (PEP 562), so importing a light module of the package
(`quant.methods` for the CLI's parser) does not import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.model.checkpoint.loader import LoadedModel, load_model
    from nanoserve.model.config import ModelConfig, ModelLoadError, UnsupportedModelError
    from nanoserve.model.decoder import CausalLM

__all__ = ["CausalLM", "LoadedModel", "ModelConfig", "ModelLoadError", "UnsupportedModelError", "load_model"]

_EXPORTS = {"LoadedModel": "checkpoint.loader", "load_model": "checkpoint.loader", "ModelConfig": "config",
            "ModelLoadError": "config", "UnsupportedModelError": "config", "CausalLM": "decoder"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
