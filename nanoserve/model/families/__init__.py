"""The model families nanoserve runs: one module each, and the registry built from them.

Adding a family is one module declaring its `Family` (its `LayerShape` saying how its layers differ
from Llama's) and one entry in `FAMILIES` (docs/architecture.md, "Adding a model family").
"""

from nanoserve.model.families.family import (
    GLOBAL_TENSORS,
    LLAMA_LAYER_TENSORS,
    MOE_TENSORS,
    ROPE_TYPES,
    Family,
    FamilyRegistry,
    GGUFArch,
    LayerShape,
    MoEShape,
    TensorName,
    TensorRef,
)
from nanoserve.model.families.gemma3 import GEMMA3
from nanoserve.model.families.granite import GRANITE
from nanoserve.model.families.llama import LLAMA
from nanoserve.model.families.mistral import MISTRAL
from nanoserve.model.families.mixtral import MIXTRAL
from nanoserve.model.families.olmo2 import OLMO2
from nanoserve.model.families.olmoe import OLMOE
from nanoserve.model.families.phi3 import PHI3
from nanoserve.model.families.qwen2 import QWEN2
from nanoserve.model.families.qwen3 import QWEN3
from nanoserve.model.families.qwen3_moe import QWEN3_MOE
from nanoserve.model.families.smollm3 import SMOLLM3

# Llama before Mistral: a GGUF file of architecture `llama` reads as Llama (as Mixtral with experts).
FAMILIES = FamilyRegistry((LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GRANITE, SMOLLM3, GEMMA3, OLMO2, QWEN3_MOE, MIXTRAL,
                           OLMOE))

__all__ = ["FAMILIES", "GLOBAL_TENSORS", "LLAMA_LAYER_TENSORS", "MOE_TENSORS", "ROPE_TYPES", "Family", "FamilyRegistry",
           "GGUFArch", "LayerShape", "MoEShape", "TensorName", "TensorRef"]
