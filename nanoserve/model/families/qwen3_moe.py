"""Qwen3-MoE: `Qwen3MoeForCausalLM` (Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's attention (per-head q/k RMSNorm before rotary, a sliding window only under
`use_sliding_window`) with a sparse mixture of experts in place of the MLP: a router over
`num_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok` of them per token,
renormalised when `norm_topk_prob` says so, the routing weights rounded to the model's dtype (as
transformers' router returns them). `decoder_sparse_step` and `mlp_only_layers` make some layers dense
MLPs of `intermediate_size`. No shared experts (Qwen2-MoE's, not declared).

llama.cpp stores it as `qwen3moe` (rotate-half rotary), always renormalising the top-k weights, and
every layer MoE; the expert width is `qwen3moe.expert_feed_forward_length`.
"""

from nanoserve.model.families.family import (
    LLAMA_LAYER_TENSORS,
    MOE_TENSORS,
    QK_NORM_TENSORS,
    Family,
    GGUFArch,
    MoEShape,
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    gguf=GGUFArch("qwen3moe"),
    bias_switch="attention_bias",
    qk_norm=True,
    sliding_window_switch="use_sliding_window",
    layer_tensors=LLAMA_LAYER_TENSORS + QK_NORM_TENSORS + MOE_TENSORS,
    native_decoder=False,  # decoder.cpp has no MoE layer: the Python forward runs
    moe=MoEShape(count_fields=("num_experts", "num_local_experts"), width_field="moe_intermediate_size",
                 norm_switch="norm_topk_prob", weights_in_dtype=True, sparse_step=True, gguf_norm=True,
                 gguf_width_key="expert_feed_forward_length"),
)
