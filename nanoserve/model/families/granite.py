"""Granite 3.x (`GraniteForCausalLM`): Llama's layers and tensor names with four multipliers from
config.json: the embedding's rows times `embedding_multiplier`, each sublayer's output times
`residual_multiplier` before its residual add, q.k times `attention_multiplier` (in place of
1 / sqrt(head_dim); transformers' default is 1.0) and the logits divided by `logits_scaling`.
llama.cpp's `granite` stores Q and K interleaved, as `llama`, and the multipliers as
`granite.embedding_scale`, `.residual_scale`, `.attention.scale` and `.logit_scale`.

Python path only: the C++ decoder (`decoder.cpp`) has no multipliers on the embedding and the
residual adds (and its greedy drafting no divisor of the logits); it would need them threaded through
its layer loop and its drafting. Granite 3.x models are 2B parameters and up, where a step's weight
reads outweigh the Python calls the native decoder saves."""

from nanoserve.model.families.family import Family, GGUFArch

GRANITE = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    gguf=GGUFArch("granite", interleaved_rotary=True, vocab_and_rope_dims=True,
                  multipliers=(("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                               ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling"))),
    bias_switch="attention_bias",
    multipliers=(("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", 1.0),
                 ("logits_scaling", 1.0)),
    native_decoder=False,
)
