"""Llama 2, 3, 3.1 and 3.2: the layout every other family starts from (`family.py`'s defaults)."""

from nanoserve.model.families.family import Family, GGUFArch

# llama.cpp's `llama` architecture, which other Llama-shaped families are converted to as well.
LLAMA_GGUF = GGUFArch("llama", interleaved_rotary=True, vocab_and_rope_dims=True)

LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    gguf=LLAMA_GGUF,
    bias_switch="attention_bias",
)
