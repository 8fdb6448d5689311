"""OLMo 2: `Olmo2ForCausalLM`.

Its layers norm each sublayer's output before the residual add and not its input ("post" norms),
and its q/k RMSNorms run over the whole q and k projections (all heads at once), before rotary.
Otherwise Llama's: SwiGLU, grouped-query attention, rotate-half rotary, an untied LM head.

No native decoder: `nanoserve/csrc/decoder.cpp` implements Llama's pre-norm layer only (its q/k norm
is per head); the Python forward runs these layers, its products and norms through `CpuLayerOps`.
llama.cpp stores it as `olmo2`, rotary halves not interleaved (NEOX order).
"""

from nanoserve.model.families.family import (
    LLAMA_LAYER_TENSORS,
    QK_NORM_TENSORS,
    Family,
    GGUFArch,
    LayerShape,
    TensorName,
)

_NORMS_BEFORE = ("input_layernorm.weight", "post_attention_layernorm.weight")

OLMO2_LAYER_TENSORS = (
    *(t for t in LLAMA_LAYER_TENSORS if t.hf not in _NORMS_BEFORE),
    *QK_NORM_TENSORS,
    TensorName("post_attention_layernorm.weight", "post_attention_norm.weight", "attn_output_norm.weight"),
    TensorName("post_feedforward_layernorm.weight", "post_ffw_norm.weight", "mlp_output_norm.weight"),
)

OLMO2 = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    gguf=GGUFArch("olmo2"),
    bias_switch="attention_bias",
    qk_norm=True,
    layer_tensors=OLMO2_LAYER_TENSORS,
    native_decoder=False,
    layer=LayerShape(norms="post", qk_norm_over="projection"),
)
