"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): Llama's layers with q/k/v and gate/up stored fused in
the checkpoint (one `qkv_proj` and one `gate_up_proj` tensor, gate rows first), rotary over the
first `partial_rotary_factor` of each head (Phi-4-mini: 0.75), and LongRoPE ("su") scaling: a
divisor per rotary frequency (short factors within the original context, long ones past it) and
cos and sin multiplied by an attention factor. A `sliding_window` in config.json always applies.
llama.cpp's `phi3` keeps the fused tensors (gate/up as `ffn_up`), the rotary dimensions, the window
and the two factor lists as tensors of their own.

The C++ decoder (`decoder.cpp`) runs Phi-3 (its rotary tables come from `CausalLM.rope_tables`,
LongRoPE's factors and attention factor included) but not partial rotary (Phi-4-mini): its rotary
step rotates whole heads, so those models take the Python path (`NativeDecoder.build`)."""

from nanoserve.model.families.family import Family, GGUFArch, TensorName

PHI3_LAYER_TENSORS = (
    TensorName("input_layernorm.weight", "attn_norm.weight", "input_layernorm.weight"),
    TensorName("self_attn.qkv_proj.weight", "attn_qkv.weight", "self_attn.qkv_proj"),
    TensorName("self_attn.o_proj.weight", "attn_output.weight", "self_attn.o_proj"),
    TensorName("post_attention_layernorm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
    TensorName("mlp.gate_up_proj.weight", "ffn_up.weight", "mlp.gate_up_proj"),
    TensorName("mlp.down_proj.weight", "ffn_down.weight", "mlp.down_proj"),
)

PHI3 = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    gguf=GGUFArch("phi3", vocab_and_rope_dims=True, sliding_window=True, longrope_tensors=True),
    rope_types=("default", "longrope"),
    partial_rotary=True,
    layer_tensors=PHI3_LAYER_TENSORS,
)
