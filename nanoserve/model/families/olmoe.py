"""OLMoE: `OlmoeForCausalLM` (OLMoE-1B-7B).

Llama's pre-norm layer with OLMo 2's q/k RMSNorms over the whole q and k projections (before
rotary) and a sparse mixture of `num_experts` experts of width `intermediate_size` in every layer,
`num_experts_per_tok` per token, renormalised only under `norm_topk_prob` (false by default), the
routing weights rounded to the model's dtype (as transformers' router returns them).
`clip_qkv` (clamping q, k and v) is refused.

llama.cpp stores it as `olmoe` (rotate-half rotary), never renormalising; its q and k norms there
have `hidden_size` weights each, so llama.cpp reads only files with as many KV heads as heads.
"""

from nanoserve.model.families.family import (
    DENSE_MLP_PARAMS,
    LLAMA_LAYER_TENSORS,
    MOE_TENSORS,
    QK_NORM_TENSORS,
    Family,
    GGUFArch,
    LayerShape,
    MoEShape,
)

OLMOE = Family(
    name="olmoe",
    architectures=("OlmoeForCausalLM",),
    gguf=GGUFArch("olmoe"),
    bias_switch="attention_bias",
    qk_norm=True,
    layer_tensors=tuple(t for t in LLAMA_LAYER_TENSORS if t.param not in DENSE_MLP_PARAMS) + QK_NORM_TENSORS
    + MOE_TENSORS,
    native_decoder=False,  # decoder.cpp has no MoE layer nor q/k norms over the projection
    layer=LayerShape(qk_norm_over="projection"),
    moe=MoEShape(count_fields=("num_experts", "num_local_experts"), width_field="intermediate_size",
                 norm_switch="norm_topk_prob", weights_in_dtype=True, sparse_step=False, gguf_norm=False),
)
