"""Qwen2 and Qwen2.5: Llama's layers with a bias on q, k and v (none on o), and a sliding window
only under `use_sliding_window`."""

from nanoserve.model.families.family import LLAMA_LAYER_TENSORS, Family, GGUFArch, TensorName

QKV_BIAS_TENSORS = (
    TensorName("self_attn.q_proj.bias", "attn_q.bias", "self_attn.qkv_bias", "q"),
    TensorName("self_attn.k_proj.bias", "attn_k.bias", "self_attn.qkv_bias", "k"),
    TensorName("self_attn.v_proj.bias", "attn_v.bias", "self_attn.qkv_bias", "v"),
)

QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    gguf=GGUFArch("qwen2"),
    qkv_bias=True,
    sliding_window_switch="use_sliding_window",
    layer_tensors=LLAMA_LAYER_TENSORS + QKV_BIAS_TENSORS,
)
