"""Gemma 3 (text): `Gemma3ForCausalLM`, and the text decoder of `Gemma3ForConditionalGeneration`.

Its layers differ from Llama's in their shape (`LayerShape`): four norms per layer (each sublayer's
input and output normed, "sandwich"), RMSNorm by (1 + w), a GeGLU MLP (tanh-approximated GELU),
per-head q/k norms, embeddings scaled by sqrt(hidden_size), attention scaled by
`query_pre_attn_scalar`**-0.5, and local layers (a sliding window, a rotary base of their own)
interleaved with global ones (by default five local to one global). An optional final logit
softcap is read too; attention logit softcapping (Gemma 2's) is refused.

No native decoder: `nanoserve/csrc/decoder.cpp` implements Llama's pre-norm SwiGLU layer only, and
Gemma's extra norms, GeGLU, embedding scale and per-layer windows and rotary tables would each
be a new path through it. The Python forward runs these layers (its products and norms still go
through the C++ `CpuLayerOps`).

llama.cpp stores it as `gemma3`, rotary halves not interleaved (NEOX order), norm weights as
(1 + w). It hard-codes what its files do not say: a local rotary base of 10000 and every sixth
layer global; the reader takes those defaults where the keys are absent.
"""

from nanoserve.model.families.family import (
    LLAMA_LAYER_TENSORS,
    QK_NORM_TENSORS,
    Family,
    GGUFArch,
    LayerShape,
    TensorName,
)

_LLAMA = {t.hf: t for t in LLAMA_LAYER_TENSORS}

# The decoder's `post_attention_layernorm` is the norm before the MLP (Llama's name for it); Gemma's
# `post_attention_layernorm` norms the attention's output.
GEMMA3_LAYER_TENSORS = (
    _LLAMA["input_layernorm.weight"],
    _LLAMA["self_attn.q_proj.weight"],
    _LLAMA["self_attn.k_proj.weight"],
    _LLAMA["self_attn.v_proj.weight"],
    _LLAMA["self_attn.o_proj.weight"],
    *QK_NORM_TENSORS,
    TensorName("post_attention_layernorm.weight", "post_attention_norm.weight", "attn_output_norm.weight"),
    TensorName("pre_feedforward_layernorm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
    _LLAMA["mlp.gate_proj.weight"],
    _LLAMA["mlp.up_proj.weight"],
    _LLAMA["mlp.down_proj.weight"],
    TensorName("post_feedforward_layernorm.weight", "post_ffw_norm.weight", "mlp_output_norm.weight"),
)

GEMMA3 = Family(
    name="gemma3_text",
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    gguf=GGUFArch("gemma3"),
    bias_switch="attention_bias",
    qk_norm=True,
    rope_types=("default", "linear"),
    layer_tensors=GEMMA3_LAYER_TENSORS,
    native_decoder=False,
    layer=LayerShape(norms="sandwich", norm_offset=1.0, embed_scale=True, interleaved_windows=True),
    activations=("gelu_pytorch_tanh", "gelu_tanh"),
    text_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."),
                   ("language_model.lm_head.", "lm_head.")),
)
