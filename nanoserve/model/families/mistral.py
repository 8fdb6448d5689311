"""Mistral: Llama's layers (never a bias), with a sliding window whenever config.json sets one.
llama.cpp's converter writes it as `llama`."""

from nanoserve.model.families.family import Family
from nanoserve.model.families.llama import LLAMA_GGUF

MISTRAL = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    gguf=LLAMA_GGUF,
)
