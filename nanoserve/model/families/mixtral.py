"""Mixtral: `MixtralForCausalLM` (Mixtral-8x7B, 8x22B).

Mistral's attention (a sliding window whenever config.json sets one) with a sparse mixture of
`num_local_experts` experts of width `intermediate_size` in every layer, `num_experts_per_tok` per
token, the top-k weights always renormalised (a softmax over the top-k logits) and kept in fp32.
Its checkpoints name the MoE block `block_sparse_moe` and each expert's matrices w1 (gate),
w3 (up) and w2 (down).

llama.cpp's converter writes it as `llama` with `llama.expert_count` > 0 (Q/K rows interleaved as
for Llama), so a `llama` file with experts reads as Mixtral.
"""

from nanoserve.model.families.family import (
    DENSE_MLP_PARAMS,
    LLAMA_LAYER_TENSORS,
    Family,
    MoEShape,
    TensorName,
)
from nanoserve.model.families.llama import LLAMA_GGUF

MIXTRAL_MOE_TENSORS = (
    TensorName("block_sparse_moe.gate.weight", "ffn_gate_inp.weight", "mlp.router"),
    TensorName("block_sparse_moe.experts.{e}.w1.weight", "ffn_gate_exps.weight", "mlp.gate_exps", experts=True),
    TensorName("block_sparse_moe.experts.{e}.w3.weight", "ffn_up_exps.weight", "mlp.up_exps", experts=True),
    TensorName("block_sparse_moe.experts.{e}.w2.weight", "ffn_down_exps.weight", "mlp.down_exps", experts=True),
)

MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    gguf=LLAMA_GGUF,
    layer_tensors=tuple(t for t in LLAMA_LAYER_TENSORS if t.param not in DENSE_MLP_PARAMS) + MIXTRAL_MOE_TENSORS,
    native_decoder=False,  # decoder.cpp has no MoE layer: the Python forward runs
    moe=MoEShape(count_fields=("num_local_experts",), width_field="intermediate_size", norm_switch=None,
                 weights_in_dtype=False, sparse_step=False, gguf_norm=True),
)
