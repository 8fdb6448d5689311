"""Building blocks of the decoder: RMSNorm, rotary position embedding (with llama3, linear and
LongRoPE scaling, over all or the first part of each head), the SwiGLU MLP. Numerics follow the
Hugging Face reference: norms in fp32, then cast."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanoserve.model.config import RopeScaling

if TYPE_CHECKING:
    from nanoserve.model.quant.quant_config import QuantConfig


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter; the loader fills every one of them."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, computed in fp32 and cast back
    to x's dtype before the product with the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """The weight and eps of one RMSNorm; the decoder applies it through its `LayerOps`."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of rotary embedding over `rotary_dim` dimensions, after the checkpoint's
    scaling rule (LongRoPE: its long factors if `long`, else its short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if long else scaling.short_factor
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope takes {rotary_dim // 2} factors, one per rotary frequency; got {len(factors)}")
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position, shaped [num_tokens, 1, rotary_dim] (halves repeated), times
    `scale` in fp32 before the cast (LongRoPE's attention factor)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, heads, head_dim] by the 'rotate half' (non-interleaved) convention,
    over its first cos.shape[-1] dimensions (all of a head but under partial rotary); the rest pass
    through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2 * inter, hidden] matrix (gate
    rows first); the decoder applies it with its `LayerOps.silu_mul` between the two products. The
    matrices of layer `layer` take the formats `quant` gives them."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, quant: QuantConfig, layer: int) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_proj = quant.make_weight(layer, "mlp.gate_up_proj", (("gate", inter), ("up", inter)), hidden,
                                              dtype)
        self.down_proj = quant.make_weight(layer, "mlp.down_proj", ((None, hidden),), inter, dtype)
