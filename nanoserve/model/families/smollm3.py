"""SmolLM3 (`SmolLM3ForCausalLM`): Llama's layers and tensor names with no rotary in some layers
(`no_rope_layers`, by default every fourth: "NoPE"), and a sliding window only under
`use_sliding_window`. llama.cpp's `smollm3` stores Q and K interleaved, as `llama`, and reads no
key for the rotary-free layers: it always takes every fourth.

The C++ decoder (`decoder.cpp`) skips the rotary step of those layers (`LayerWeights.rotary`);
the Python forward rotates them by angle 0 (cos 1, sin 0), which leaves q and k as they are."""

from nanoserve.model.families.family import Family, GGUFArch

SMOLLM3 = Family(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    gguf=GGUFArch("smollm3", interleaved_rotary=True, vocab_and_rope_dims=True, no_rope_interval=4),
    bias_switch="attention_bias",
    sliding_window_switch="use_sliding_window",
    no_rope_layers=True,
)
