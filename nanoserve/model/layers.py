"""Building blocks of the decoder: RMSNorm, rotary position embedding (with llama3 and linear
scaling), the SwiGLU MLP. Numerics follow the Hugging Face reference: norms in fp32, then cast."""

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


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, after the checkpoint's scaling rule."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position, shaped [num_tokens, 1, head_dim] (halves repeated)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, heads, head_dim] by the 'rotate half' (non-interleaved) convention."""
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
