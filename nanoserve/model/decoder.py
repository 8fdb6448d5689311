"""The decoder shared by the Llama, Qwen2, Qwen3 and Mistral families.

`CausalLM.forward` takes one flat batch: the new tokens of many sequences concatenated, with
explicit positions and the attention metadata that says where each token's K/V goes and which
cached blocks each sequence reads. There is no padding and no per-sequence Python in the model;
only the attention backend knows about sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.layers import RMSNorm, SwiGLU, apply_rope, empty_param, rope_cos_sin, rope_inv_freq


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection, optional q/k bias (Qwen2) and
    optional per-head RMSNorm on q and k before rotary (Qwen3)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = empty_param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = empty_param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.attention_bias else None
        self.o_proj = empty_param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = backend.forward(q, k, v.contiguous(), kv_cache, meta, self.scale)
        return F.linear(o.reshape(n, self.q_size), self.o_proj)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head. Parameters are created empty; a loader
    must fill every one (see `nanoserve.model.weights.load_weights`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )

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
        x = F.embedding(input_ids, self.embed_tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], meta, backend)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [n, vocab] for the given rows of hidden states."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()
