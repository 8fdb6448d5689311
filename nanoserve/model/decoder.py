"""The decoder shared by the Llama-shaped families (`nanoserve.model.families`): Llama, Qwen2,
Qwen3, Mistral, Phi-3, Granite, SmolLM3, with their `ModelConfig` switches.

`CausalLM.forward` takes one flat batch: the new tokens of many sequences concatenated, with
explicit positions and the attention metadata that says where each token's K/V goes and which
cached blocks each sequence reads. There is no padding and no per-sequence Python in the model;
only the attention backend knows about sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.layer_ops import LayerOps, TorchLayerOps
from nanoserve.model.layers import RMSNorm, SwiGLU, empty_param, rope_cos_sin, rope_inv_freq
from nanoserve.model.quant.quant_config import QuantConfig
from nanoserve.model.quant.weight_formats import LinearWeight


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection, optional q/k bias (Qwen2) and
    optional per-head RMSNorm on q and k before rotary (Qwen3), rotary over the first
    `cfg.rotary_dim` dimensions of each head and none at all in `cfg.no_rope_layers` (SmolLM3: the
    caller then passes cos = 1, sin = 0), q.k scaled by `cfg.attention_scale`. The matrices of
    layer `layer` take the formats `quant` gives them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.rotary = layer not in cfg.no_rope_layers
        self.eps = cfg.rms_norm_eps
        self.qkv_proj = quant.make_weight(layer, "self_attn.qkv_proj",
                                          (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)),
                                          cfg.hidden_size, dtype)
        self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.attention_bias else None
        self.o_proj = quant.make_weight(layer, "self_attn.o_proj", ((None, cfg.hidden_size),), self.q_size, dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, ops: LayerOps) -> torch.Tensor:
        n = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj, self.qkv_bias)
        q_weight = None if self.q_norm is None else self.q_norm.weight
        k_weight = None if self.k_norm is None else self.k_norm.weight
        q, k = ops.qk_norm_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, q_weight, k_weight,
                                self.eps)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale)
        return ops.linear(o.reshape(n, self.q_size), self.o_proj)


class DecoderLayer(nn.Module):
    """Pre-norm block on a residual stream: h += attn(norm(h)); h += mlp(norm(h)). Each add is
    fused into the norm after it (`LayerOps.rms_norm` with a residual), so a layer takes the previous
    sublayer's output, adds it into the stream first, and returns its own MLP's output unadded.
    Each sublayer's output is multiplied by `cfg.residual_multiplier` before its add (Granite)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, quant, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, quant, layer)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                ops: LayerOps) -> torch.Tensor:
        """`x` is added into `residual` (in place) before anything else; returns the MLP's output,
        which the caller adds in the same way."""
        norm = self.input_layernorm
        h = self.self_attn(ops.rms_norm(x, norm.weight, norm.eps, residual), cos, sin, kv_cache, meta, backend, ops)
        norm, mlp = self.post_attention_layernorm, self.mlp
        h = ops.silu_mul(ops.linear(ops.rms_norm(self._scaled(h), norm.weight, norm.eps, residual), mlp.gate_up_proj))
        return self._scaled(ops.linear(h, mlp.down_proj))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. Parameters are created empty; a loader
    must fill every one (see `nanoserve.model.checkpoint.weights.load_weights`). Each matrix is a `LinearWeight`
    in the format `quant` gives it (dense by default; activations and norms are always `dtype`).
    The embedding table is a `LinearWeight` [vocab, hidden] (`ops.embed` gathers its rows for the
    input tokens, in `dtype`), and with tied embeddings (`lm_head` None) it is the LM head too. `ops`
    carries out the products and elementwise steps (`TorchLayerOps` unless the engine picks fused
    kernels for its device).
    `inv_freq` is fixed at construction (no loader writes it), so the rotary tables of `rope`,
    built from it at first use, stay valid. The embedding's rows are multiplied by
    `cfg.embedding_multiplier` and the logits divided by `cfg.logits_scaling` (Granite)."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig | None = None) -> None:
        super().__init__()
        quant = quant or QuantConfig()
        self.cfg = cfg
        self.dtype = dtype
        self.ops: LayerOps = TorchLayerOps()
        vocab = ((None, cfg.vocab_size),)
        self.embed_tokens = quant.make_weight(None, "embed_tokens", vocab, cfg.hidden_size, dtype)
        # An nn.ModuleList (so its parameters are the model's), typed as the sequence it is.
        self.layers = cast(Sequence[DecoderLayer], nn.ModuleList(
            DecoderLayer(cfg, dtype, quant, i) for i in range(cfg.num_hidden_layers)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head: LinearWeight | None = (
            None if cfg.tie_word_embeddings else quant.make_weight(None, "lm_head", vocab, cfg.hidden_size, dtype))
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.longrope_long),
            persistent=False,
        )
        self.rope_scale = cfg.rope_attention_factor
        self.context: int | None = None  # what `use_context` was given
        # Per dtype: cos and sin [table_len, 1, rotary_dim] on the CPU (see `rope`).
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def use_context(self, max_len: int) -> None:
        """Fixes the rotary frequencies for sequences of at most `max_len` tokens: under LongRoPE its
        long factors when `max_len` exceeds the original context, else its short ones (llama.cpp's
        rule, by its context size; until called, by `cfg.longrope_long`). The engine's builder calls
        it once, before any forward pass, with the resolved max_model_len; other rotary rules
        ignore it."""
        self.context = max_len
        scaling = self.cfg.rope_scaling
        if scaling.rope_type == "longrope":
            long = max_len > scaling.original_max_position_embeddings
            self.inv_freq.copy_(rope_inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta, scaling, long))
            self._rope_tables.clear()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, 1, rotary_dim] of `positions` (non-negative), bit for bit what
        `rope_cos_sin` computes (with `rope_scale`). On the CPU they are rows of a table of the
        positions below a power of two (at least 1024) past the largest position seen so far, built
        for each dtype by `rope_cos_sin` itself and rebuilt twice as long when a position passes it
        (torch gives each element of cos and sin the same bits whatever the tensor's size or split
        among threads).
        Other devices compute them directly: the table's size check would wait for the device, and
        the few elementwise kernels cost little there."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scale)
        cos, sin = self.rope_tables(int(positions.max()) + 1, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def rope_tables(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables cos and sin [table_len, 1, rotary_dim] (contiguous; row p for position p) of
        `rope`, with table_len >= num_positions."""
        tables = self._rope_tables.get(dtype)
        if tables is None or tables[0].shape[0] < num_positions:
            size = max(1024, 1 << (num_positions - 1).bit_length())
            tables = rope_cos_sin(torch.arange(size), self.inv_freq, dtype, self.rope_scale)
            self._rope_tables[dtype] = tables
        return tables

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden_size] (normed)."""
        residual = self.embed(input_ids)
        cos, sin = self.rope(positions, residual.dtype)
        # The rotation by angle 0, for layers without rotary (only built for models that have them).
        identity = (torch.ones_like(cos), torch.zeros_like(sin)) if self.cfg.no_rope_layers else (cos, sin)
        x = torch.zeros_like(residual)  # what the first layer adds into the stream
        for i, layer in enumerate(self.layers):
            layer_cos, layer_sin = (cos, sin) if layer.self_attn.rotary else identity
            x = layer(x, residual, layer_cos, layer_sin, kv_caches[i], meta, backend, self.ops)
        return self.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows of the embedding table [num_tokens, hidden_size]: a new tensor, which
        becomes the residual stream (a vocab-parallel model sums its ranks' rows here), times
        `cfg.embedding_multiplier`."""
        return self.scale_embedding(self.ops.embed(input_ids, self.embed_tokens))

    def scale_embedding(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding rows times `cfg.embedding_multiplier`."""
        return rows if self.cfg.embedding_multiplier == 1.0 else rows * self.cfg.embedding_multiplier

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits divided by `cfg.logits_scaling`."""
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] for the given rows of hidden states (`LayerOps.logits`, divided by
        `cfg.logits_scaling`)."""
        return self.scale_logits(self.ops.logits(hidden, self.head))

    @property
    def head(self) -> LinearWeight:
        """The LM head's weight [vocab, hidden]: `lm_head`, or the embedding table it is tied to."""
        return self.embed_tokens if self.lm_head is None else self.lm_head
