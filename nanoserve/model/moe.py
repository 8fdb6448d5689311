"""Sparse mixture-of-experts MLPs (Shazeer et al., 2017; Mixtral, Qwen3-MoE, OLMoE): the layer's
weights, its router, and the grouped product that every `LayerOps` can run for any weight format.

A token's MLP output is sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)) over the k experts e = ids_j
its router chose (`route`: softmax over the router's E logits in fp32, top-k, renormalised or not).
The expert matrices are ordinary `LinearWeight`s holding every expert stacked by rows, as GGUF
stores them (`ffn_gate_exps` [E, I, H] is E * I rows of H values): `gate_exps` and `up_exps`
[E * I, H] (expert e's rows e * I .. (e + 1) * I), `down_exps` [E * H, I]; each in its own format
(dense, or any GGUF block format: a Q4_K_M file's gate/up are q4_k and its down q6_k).

`grouped_moe_ffn` groups the step's tokens by expert, so each chosen expert's rows are read once per
call for all its tokens and experts no token chose are not read: a view of each chosen expert's rows
(`expert_rows`) multiplied by the ops' own `linear`, whatever its format. Invariant (batch
invariance): a token's output is the same bits whatever other tokens share the call, given products
that are (`CpuLayerOps`'): its experts' terms are added in increasing expert order into an fp32 sum,
each term its own rows' products.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from nanoserve.model.config import ModelConfig
from nanoserve.model.quant.block_quant import BlockQuantWeight
from nanoserve.model.quant.quant_config import QuantConfig
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight, UnsupportedWeightFormat


class ExpertProducts(Protocol):
    """What `grouped_moe_ffn` needs of a `LayerOps`: its products and SwiGLU's elementwise step."""

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class SparseMoE(nn.Module):
    """The weights of one MoE layer: `router` [E, H] (dense in the model's dtype unless the
    checkpoint stores it otherwise) and the stacked experts `gate_exps`, `up_exps` [E * I, H] and
    `down_exps` [E * H, I] of layer `layer`, in the formats `quant` gives them. The decoder routes
    with `route` and applies the experts with `LayerOps.moe_ffn`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant: QuantConfig, layer: int) -> None:
        super().__init__()
        e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = e
        self.top_k = cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.weights_dtype = dtype if cfg.moe_weights_in_dtype else None
        self.router = quant.make_weight(layer, "mlp.router", ((None, e),), h, dtype)
        self.gate_exps = quant.make_weight(layer, "mlp.gate_exps", ((None, e * inter),), h, dtype)
        self.up_exps = quant.make_weight(layer, "mlp.up_exps", ((None, e * inter),), h, dtype)
        self.down_exps = quant.make_weight(layer, "mlp.down_exps", ((None, e * h),), inter, dtype)

    def route(self, x: torch.Tensor, ops: ExpertProducts) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts of each row of x [T, H] and their weights (`route` on the router's logits,
        computed in x's dtype by `ops`)."""
        return route(ops.linear(x, self.router), self.top_k, self.normalize, self.weights_dtype)


def route(logits: torch.Tensor, top_k: int, normalize: bool,
          weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids int64 [T, k] and topk_weights fp32 [T, k] from router logits [T, E]: softmax over
    the experts in fp32, the k largest probabilities (ties to the lower expert, as torch.topk
    breaks them), divided by their sum when `normalize`, then rounded to `weights_dtype` where
    given (transformers' Qwen3-MoE and OLMoE routers return them so). Each row on its own."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype).float()
    return ids, weights


def expert_rows(w: LinearWeight, expert: int, num_experts: int) -> LinearWeight:
    """Expert `expert`'s rows of a stacked expert matrix, as a weight of its format sharing `w`'s
    storage (a view, no copy). Raises `UnsupportedWeightFormat` for a format other than dense or
    block-quantized."""
    rows = w.out_features // num_experts
    lo = expert * rows
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[lo:lo + rows])
    if isinstance(w, BlockQuantWeight):
        return BlockQuantWeight(w.format, w.blocks[lo:lo + rows], w.in_features, w.dtype)
    raise UnsupportedWeightFormat("expert_rows", w.format)


def grouped_moe_ffn(ops: ExpertProducts, x: torch.Tensor, gate: LinearWeight, up: LinearWeight,
                    down: LinearWeight, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
    for x [T, H]; returns [T, H] in x's dtype, summed in fp32 in increasing expert order. The tokens
    are grouped by expert: one product of each chosen expert's rows (`expert_rows`) with all its
    tokens, through `ops`; experts no token chose are not read. E is gate.out_features //
    down.in_features."""
    num_experts = gate.out_features // down.in_features
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    if tokens and not (int(flat.min()) >= 0 and int(flat.max()) < num_experts):
        raise IndexError(f"moe_ffn: an expert id outside [0, {num_experts})")
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        rows = pairs // k
        xe = x.index_select(0, rows)
        gate_up = torch.cat((ops.linear(xe, expert_rows(gate, expert, num_experts)),
                             ops.linear(xe, expert_rows(up, expert, num_experts))), dim=1)
        ye = ops.linear(ops.silu_mul(gate_up), expert_rows(down, expert, num_experts))
        out.index_add_(0, rows, ye.float() * weights.index_select(0, pairs)[:, None])
    return out.to(x.dtype)
