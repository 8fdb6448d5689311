"""Qwen3: Llama's layers with a per-head RMSNorm on q and k before rotary, and a sliding window
only under `use_sliding_window`."""

from nanoserve.model.families.family import LLAMA_LAYER_TENSORS, QK_NORM_TENSORS, Family, GGUFArch

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    gguf=GGUFArch("qwen3"),
    bias_switch="attention_bias",
    qk_norm=True,
    sliding_window_switch="use_sliding_window",
    layer_tensors=LLAMA_LAYER_TENSORS + QK_NORM_TENSORS,
)
