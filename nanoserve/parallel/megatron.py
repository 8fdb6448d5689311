"""Megatron-LM's tensor-parallel decoder (Shoeybi et al., 2019) over nanoserve's `CausalLM`.

Rank r of N holds, in every layer: the q, k and v heads r*h/N .. (r+1)*h/N - 1 (its rows of
`qkv_proj`: column parallel), the same slice of gate and of up (`gate_up_proj`: column parallel),
and the matching input columns of `o_proj` and `down_proj` (row parallel), whose partial products
are summed over the ranks (an all-reduce) before they enter the residual stream; the norms whole.
The embedding table and the LM head are vocab parallel: rank r holds vocab rows
r*V'/N .. (r+1)*V'/N - 1 (V' = V rounded up to a multiple of N, padded with zero rows); an
embedding lookup sums the ranks' rows (each rank gives zeros for tokens it does not hold) and the
logits are the ranks' columns gathered side by side on rank 0, the one that samples.

A shard is a plain `CausalLM` built from the config of one rank (`shard_config`: h/N query heads,
kv/N KV heads, I/N intermediate, V'/N vocab rows), so attention, the KV cache (sharded by KV heads)
and the layer ops are the unsharded ones; `RowParallelOps` adds the all-reduce after the row
parallel products. Every rank's residual stream holds the same values, so each computes the same
norms and the next layer's inputs on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from nanoserve.model.config import ModelConfig
from nanoserve.model.decoder import CausalLM
from nanoserve.model.layer_ops import LayerOps
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight
from nanoserve.parallel.group import TensorParallelGroup


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one rank of `world_size` holds. Raises ValueError unless the query heads, the KV
    heads and the intermediate size all divide evenly, and for layers other than Llama's pre-norm
    ones (the shards copy only those norms; a q/k norm over the whole projection would need the
    ranks' sums of squares), and for mixtures of experts (no expert is sharded)."""
    if cfg.norms != "pre" or cfg.qk_norm_over != "head":
        raise ValueError(f"tensor parallelism does not implement {cfg.family}'s layers "
                         f"(norms={cfg.norms!r}, q/k norm over the {cfg.qk_norm_over})")
    if cfg.moe_layers:
        raise ValueError(f"tensor parallelism does not implement mixture-of-experts layers ({cfg.family})")
    sizes = {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
             "intermediate_size": cfg.intermediate_size}
    uneven = [f"{name}={size}" for name, size in sizes.items() if size % world_size]
    if uneven:
        raise ValueError(f"tensor_parallel_size={world_size} must divide {', '.join(uneven)} of the model")
    return dataclasses.replace(cfg, vocab_size=-(-cfg.vocab_size // world_size),
                               num_attention_heads=cfg.num_attention_heads // world_size,
                               num_key_value_heads=cfg.num_key_value_heads // world_size,
                               intermediate_size=cfg.intermediate_size // world_size)


class RowParallelOps:
    """`LayerOps` whose products with the row-parallel weights it was given are summed over the
    group (in place, after `inner`'s product); every other step is `inner`'s. The weights are
    matched by identity, one set lookup a product."""

    def __init__(self, inner: LayerOps, group: TensorParallelGroup, row_parallel: Iterable[LinearWeight]) -> None:
        self.inner = inner
        self.group = group
        self.row_parallel = frozenset(row_parallel)

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.inner.linear(x, w, bias)
        return self.group.all_reduce(y) if w in self.row_parallel else y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.rms_norm(x, weight, eps, residual)

    def qk_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.qk_norm_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.inner.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.inner.gelu_tanh_mul(gate_up)

    def moe_ffn(self, x: torch.Tensor, gate: LinearWeight, up: LinearWeight, down: LinearWeight,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """`inner`'s: a shard has no experts (`shard_config` refuses mixtures of experts), so none is
        row parallel."""
        return self.inner.moe_ffn(x, gate, up, down, topk_ids, topk_weights)

    def embed(self, ids: torch.Tensor, table: LinearWeight) -> torch.Tensor:
        return self.inner.embed(ids, table)

    def logits(self, x: torch.Tensor, head: LinearWeight) -> torch.Tensor:
        return self.inner.logits(x, head)


class TensorParallelCausalLM(CausalLM):
    """One rank's shard (see the module's docstring). `cfg` is the shard's (`shard_config`);
    `vocab_size` is the whole model's, the width of `compute_logits`. Every forward pass and every
    `compute_logits` is a collective: all ranks make the same calls on same-shaped inputs."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, vocab_size: int, group: TensorParallelGroup,
                 inner_ops: LayerOps) -> None:
        super().__init__(cfg, dtype)
        self.vocab_size = vocab_size
        self.group = group
        self.vocab_start = group.rank * cfg.vocab_size
        self.ops = RowParallelOps(inner_ops, group, (w for layer in self.layers
                                                     for w in (layer.self_attn.o_proj, layer.dense_mlp.down_proj)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.cfg.vocab_size)
        rows = self.ops.embed(local.masked_fill(elsewhere, 0), self.embed_tokens)
        return self.scale_embedding(self.group.all_reduce(rows.masked_fill_(elsewhere[:, None], 0)))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """On rank 0 the whole vocabulary's fp32 logits, gathered from the ranks' columns; on the
        others (which sample nothing) their own columns."""
        local = self.ops.logits(hidden, self.head)
        gathered = self.group.gather(local)
        return local if gathered is None else self.scale_logits(gathered[:, : self.vocab_size])


def _dense(w: LinearWeight, name: str) -> torch.Tensor:
    if not isinstance(w, DenseWeight):
        raise ValueError(f"tensor parallelism shards dense weights; {name} is {w.format!r}")
    return w.weight


def _column_shard(t: torch.Tensor, sizes: tuple[int, ...], rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s share of each block of `sizes` rows of `t` (q, k, v or gate, up), in order."""
    return torch.cat([block.chunk(world_size)[rank] for block in t.split(sizes)])


def _vocab_shard(t: torch.Tensor, rows: int, rank: int) -> torch.Tensor:
    """Rows rank*rows .. (rank+1)*rows - 1 of `t`, zero rows past its end."""
    out = t.new_zeros(rows, t.shape[1])
    part = t[rank * rows: (rank + 1) * rows]
    out[: part.shape[0]] = part
    return out


@torch.no_grad()
def shard_model(full: CausalLM, group: TensorParallelGroup) -> TensorParallelCausalLM:
    """This rank's shard of a loaded model (on the model's device, in its dtype, on its layer ops,
    every weight dense); `full` is left as it was. Raises ValueError for a shape that does not
    divide (`shard_config`) or a weight in another format."""
    cfg, rank, n = full.cfg, group.rank, group.world_size
    device = full.norm.weight.device
    with torch.device(device):
        shard = TensorParallelCausalLM(shard_config(cfg, n), full.dtype, cfg.vocab_size, group, full.ops)
    vocab_rows = shard.cfg.vocab_size
    shard.embed_tokens.copy_(_vocab_shard(_dense(full.embed_tokens, "embed_tokens"), vocab_rows, rank))
    if full.lm_head is not None and shard.lm_head is not None:
        shard.lm_head.copy_(_vocab_shard(_dense(full.lm_head, "lm_head"), vocab_rows, rank))
    shard.norm.weight.copy_(full.norm.weight)
    for i, (src, dst) in enumerate(zip(full.layers, shard.layers, strict=True)):
        a, b = src.self_attn, dst.self_attn
        qkv = (a.q_size, a.kv_size, a.kv_size)
        b.qkv_proj.copy_(_column_shard(_dense(a.qkv_proj, f"layer {i} qkv_proj"), qkv, rank, n))
        if a.qkv_bias is not None and b.qkv_bias is not None:
            b.qkv_bias.copy_(_column_shard(a.qkv_bias, qkv, rank, n))
        b.o_proj.copy_(_dense(a.o_proj, f"layer {i} o_proj").chunk(n, dim=1)[rank])
        for src_norm, dst_norm in ((a.q_norm, b.q_norm), (a.k_norm, b.k_norm)):
            if src_norm is not None and dst_norm is not None:
                dst_norm.weight.copy_(src_norm.weight)
        for src_norm, dst_norm in ((src.input_layernorm, dst.input_layernorm),
                                   (src.post_attention_layernorm, dst.post_attention_layernorm)):
            if src_norm is not None and dst_norm is not None:
                dst_norm.weight.copy_(src_norm.weight)
        inter = src.dense_mlp.inter
        dst.dense_mlp.gate_up_proj.copy_(_column_shard(_dense(src.dense_mlp.gate_up_proj, f"layer {i} gate_up_proj"),
                                                       (inter, inter), rank, n))
        dst.dense_mlp.down_proj.copy_(_dense(src.dense_mlp.down_proj, f"layer {i} down_proj").chunk(n, dim=1)[rank])
    return shard.eval()
