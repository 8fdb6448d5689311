"""The decoder shared by every family (`nanoserve.model.families`): Llama's pre-norm layer and the
variants a family's `LayerShape` declares (sandwich and post norms, GeGLU, q/k norms over the
projection, interleaved local and global layers), with the `ModelConfig` switches (partial and
LongRoPE rotary, rotary-free layers, scalar multipliers of the embedding, the residual adds, the
attention scores and the logits, a final logit softcap).

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
from nanoserve.model.config import ModelConfig, RopeScaling
from nanoserve.model.layer_ops import LayerOps, TorchLayerOps
from nanoserve.model.layers import RMSNorm, SwiGLU, empty_param, rope_cos_sin, rope_inv_freq
from nanoserve.model.moe import SparseMoE
from nanoserve.model.quant.quant_config import QuantConfig
from nanoserve.model.quant.weight_formats import LinearWeight


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection, optional q/k bias (Qwen2) and
    optional RMSNorm on q and k before rotary, per head (Qwen3, Gemma 3) or over the whole
    projection (OLMo 2), rotary over the first `cfg.rotary_dim` dimensions of each head and none at
    all in `cfg.no_rope_layers` (SmolLM3: the caller then passes cos = 1, sin = 0), q.k scaled by
    `cfg.attention_scale`. A local layer (`window` set) attends to its last `window` positions only.
    The matrices of layer `layer` take the formats `quant` gives them."""

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
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.norm_over_projection = cfg.qk_norm_over == "projection"
        self.qkv_proj = quant.make_weight(layer, "self_attn.qkv_proj",
                                          (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)),
                                          cfg.hidden_size, dtype)
        self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.attention_bias else None
        self.o_proj = quant.make_weight(layer, "self_attn.o_proj", ((None, cfg.hidden_size),), self.q_size, dtype)
        q_dim, k_dim = (self.q_size, self.kv_size) if self.norm_over_projection else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend, ops: LayerOps) -> torch.Tensor:
        n = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj, self.qkv_bias)
        q_weight = None if self.q_norm is None else self.q_norm.weight
        k_weight = None if self.k_norm is None else self.k_norm.weight
        if self.norm_over_projection and q_weight is not None and k_weight is not None:
            qk = self.q_size + self.kv_size
            qkv = torch.cat((ops.rms_norm(qkv[:, : self.q_size].contiguous(), q_weight, self.eps),
                             ops.rms_norm(qkv[:, self.q_size: qk].contiguous(), k_weight, self.eps),
                             qkv[:, qk:]), dim=1)
            q_weight = k_weight = None
        q, k = ops.qk_norm_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, q_weight, k_weight,
                                self.eps)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale, self.window)
        return ops.linear(o.reshape(n, self.q_size), self.o_proj)


class DecoderLayer(nn.Module):
    """A block on a residual stream: h += out(attn(pre(h))); h += out(mlp(pre(h))), where `pre` is
    a norm for "pre" and "sandwich" layers and the identity for "post" ones, and `out` a norm for
    "sandwich" and "post" layers and the identity for "pre" ones (`ModelConfig.norms`). Each add is
    fused into the norm after it (`LayerOps.rms_norm` with a residual) or done in place where there
    is none, so a layer takes the previous sublayer's output, adds it into the stream first, and
    returns its own MLP's output (normed, if `out` is a norm) unadded. Each sublayer's output, after
    its `out` norm, is multiplied by `cfg.residual_multiplier` before its add (Granite).

    Norms: `input_layernorm` before attention, `post_attention_layernorm` before the MLP (Llama's
    names; both None for "post" layers), `attn_output_norm` and `mlp_output_norm` after each
    sublayer (None for "pre" layers). The MLP's gate takes SiLU (SwiGLU) or tanh-GELU (GeGLU); in
    `cfg.moe_layers` the MLP is a sparse mixture of SwiGLU experts (`SparseMoE`: routed, then
    `LayerOps.moe_ffn`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig, layer: int) -> None:
        super().__init__()
        pre, out = cfg.norms != "post", cfg.norms != "pre"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if pre else None
        self.self_attn = Attention(cfg, dtype, quant, layer)
        self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if out else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if pre else None
        self.mlp: SwiGLU | SparseMoE = (SparseMoE(cfg, dtype, quant, layer) if layer in cfg.moe_layers
                                        else SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, quant, layer))
        self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if out else None
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.local = bool(cfg.layer_windows) and cfg.layer_windows[layer] is not None
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                ops: LayerOps) -> torch.Tensor:
        """`x` is added into `residual` (in place) before anything else; returns the MLP's output,
        which the caller adds in the same way."""
        h = self.self_attn(_enter(x, residual, self.input_layernorm, ops), cos, sin, kv_cache, meta, backend, ops)
        h = self._scaled(_leave(h, self.attn_output_norm, ops))
        x = _enter(h, residual, self.post_attention_layernorm, ops)
        mlp = self.mlp
        if isinstance(mlp, SparseMoE):
            ids, weights = mlp.route(x, ops)
            mlp.count(ids)
            h = ops.moe_ffn(x, mlp.gate_exps, mlp.up_exps, mlp.down_exps, ids, weights)
        else:
            gate_up = ops.linear(x, mlp.gate_up_proj)
            h = ops.linear(ops.gelu_tanh_mul(gate_up) if self.gelu else ops.silu_mul(gate_up), mlp.down_proj)
        return self._scaled(_leave(h, self.mlp_output_norm, ops))

    @property
    def dense_mlp(self) -> SwiGLU:
        """The layer's dense MLP, for code that runs dense layers only; TypeError in an MoE layer."""
        if not isinstance(self.mlp, SwiGLU):
            raise TypeError("a mixture-of-experts layer has no dense MLP")
        return self.mlp

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


def _enter(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm | None, ops: LayerOps) -> torch.Tensor:
    """Adds `x` into `residual` in place and returns the sublayer's input: the norm of the sum, or
    with no norm the stream itself (the sublayer reads it before the next add changes it)."""
    if norm is None:
        return residual.add_(x)
    return ops.rms_norm(x, norm.weight, norm.eps, residual)


def _leave(h: torch.Tensor, norm: RMSNorm | None, ops: LayerOps) -> torch.Tensor:
    """A sublayer's output as it enters the stream: normed when the layer norms its outputs."""
    return h if norm is None else ops.rms_norm(h, norm.weight, norm.eps)


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. Parameters are created empty; a loader
    must fill every one (see `nanoserve.model.checkpoint.weights.load_weights`). Each matrix is a `LinearWeight`
    in the format `quant` gives it (dense by default; activations and norms are always `dtype`).
    The embedding table is a `LinearWeight` [vocab, hidden] (`ops.embed` gathers its rows for the
    input tokens, in `dtype`), and with tied embeddings (`lm_head` None) it is the LM head too. `ops`
    carries out the products and elementwise steps (`TorchLayerOps` unless the engine picks fused
    kernels for its device).
    `inv_freq` (and `local_inv_freq`, the local layers' when they rotate by a base of their own) is
    fixed at construction (no loader writes it; `use_context` may pick LongRoPE's other factors
    once, before any forward pass), so the rotary tables of `rope`, built from it at first use, stay
    valid. The embedding's rows are multiplied by `cfg.embedding_multiplier` (Granite's multiplier,
    Gemma's sqrt(hidden_size)); the logits are divided by `cfg.logits_scaling` (Granite) and then
    softcapped by `cfg.final_logit_softcap` (Gemma 3), where the config has them."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)
    local_inv_freq: torch.Tensor | None

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
        local = None if cfg.local_rope_theta is None else rope_inv_freq(cfg.rotary_dim, cfg.local_rope_theta,
                                                                        RopeScaling())
        self.register_buffer("local_inv_freq", local, persistent=False)
        self.rope_scale = cfg.rope_attention_factor
        self.context: int | None = None  # what `use_context` was given
        # Per (dtype, local): cos and sin [table_len, 1, rotary_dim] on the CPU (see `rope`).
        self._rope_tables: dict[tuple[torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]] = {}

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

    def rope(self, positions: torch.Tensor, dtype: torch.dtype,
             local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, 1, rotary_dim] of `positions` (non-negative), bit for bit what
        `rope_cos_sin` computes (with `rope_scale` for the global rotation). On the CPU they are rows
        of a table of the positions below a power of two (at least 1024) past the largest position
        seen so far, built for each dtype by `rope_cos_sin` itself and rebuilt twice as long when a
        position passes it (torch gives each element of cos and sin the same bits whatever the
        tensor's size or split among threads).
        Other devices compute them directly: the table's size check would wait for the device, and
        the few elementwise kernels cost little there. `local`: the local layers' rotation."""
        inv_freq = self.local_inv_freq if local else self.inv_freq
        assert inv_freq is not None, "this model has no local rotary base"
        if positions.device.type != "cpu" or positions.numel() == 0:
            return rope_cos_sin(positions, inv_freq, dtype, 1.0 if local else self.rope_scale)
        cos, sin = self.rope_tables(int(positions.max()) + 1, dtype, local)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def rope_tables(self, num_positions: int, dtype: torch.dtype,
                    local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The CPU tables cos and sin [table_len, 1, rotary_dim] (contiguous; row p for position p) of
        `rope`, with table_len >= num_positions."""
        tables = self._rope_tables.get((dtype, local))
        if tables is None or tables[0].shape[0] < num_positions:
            inv_freq = self.local_inv_freq if local else self.inv_freq
            assert inv_freq is not None, "this model has no local rotary base"
            size = max(1024, 1 << (num_positions - 1).bit_length())
            tables = rope_cos_sin(torch.arange(size), inv_freq, dtype, 1.0 if local else self.rope_scale)
            self._rope_tables[(dtype, local)] = tables
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
        local = self.rope(positions, residual.dtype, local=True) if self.local_inv_freq is not None else (cos, sin)
        # The rotation by angle 0, for layers without rotary (only built for models that have them).
        identity = (torch.ones_like(cos), torch.zeros_like(sin)) if self.cfg.no_rope_layers else (cos, sin)
        x = torch.zeros_like(residual)  # what the first layer adds into the stream
        for i, layer in enumerate(self.layers):
            c, s = (local if layer.local else (cos, sin)) if layer.self_attn.rotary else identity
            x = layer(x, residual, c, s, kv_caches[i], meta, backend, self.ops)
        return self.ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows of the embedding table [num_tokens, hidden_size]: a new tensor, which
        becomes the residual stream (a vocab-parallel model sums its ranks' rows here), times
        `cfg.embedding_multiplier`."""
        return self.scale_embedding(self.ops.embed(input_ids, self.embed_tokens))

    def scale_embedding(self, rows: torch.Tensor) -> torch.Tensor:
        """Embedding rows times `cfg.embedding_multiplier`, in place, the multiplier rounded to the
        rows' dtype first (as transformers' Gemma does; its Granite multiplies by the unrounded
        float, which differs only where the multiplier is not exact in that dtype)."""
        m = self.cfg.embedding_multiplier
        return rows if m == 1.0 else rows.mul_(torch.tensor(m, dtype=rows.dtype))

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits divided by `cfg.logits_scaling`, then softcapped to cap * tanh(logits / cap)
        for cap = `cfg.final_logit_softcap` where set."""
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] for the given rows of hidden states (`LayerOps.logits`, then
        `scale_logits`)."""
        return self.scale_logits(self.ops.logits(hidden, self.head))

    @property
    def moe_layers(self) -> list[SparseMoE]:
        """The mixture-of-experts MLPs, in layer order (none for a dense model)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def take_expert_load(self) -> torch.Tensor | None:
        """Tokens routed to each expert of each MoE layer since the previous call, [MoE layers, E]
        int64 on the CPU (a token counts once in each of its k experts), the counts then zeroed;
        None for a dense model. One device-to-host copy of the stacked counts."""
        if not self.cfg.moe_layers:  # a dense model: no walk over its layers at each step
            return None
        layers = self.moe_layers
        load = torch.stack([m.tokens_per_expert for m in layers]).cpu()
        for m in layers:
            m.tokens_per_expert.zero_()
        return load

    @property
    def head(self) -> LinearWeight:
        """The LM head's weight [vocab, hidden]: `lm_head`, or the embedding table it is tied to."""
        return self.embed_tokens if self.lm_head is None else self.lm_head
