"""The computations of a decoder layer behind one interface: the matrix products, RMSNorm with the
residual add before it, per-head q/k RMSNorm with rotary embedding, SwiGLU's silu(gate) * up and
GeGLU's gelu_tanh(gate) * up.

`TorchLayerOps` is the reference: F.linear and the Hugging Face numerics of
`nanoserve.model.layers`, on any device, capturable in CUDA graphs. `CpuLayerOps` runs the same
steps through nanoserve's C++ (`nanoserve/csrc/`): each elementwise step one call where torch makes
3-15 (most of an RMSNorm of one row in torch is the Python around its seven calls), and every
product through `linear.cpp` (dense weights) or `quant.cpp` (block-quantized ones), which read each
row of the weight once for all rows of x.

Invariants shared by both:
- `rms_norm` with a residual adds x into the residual in place (residual += x, rounded to the
  dtype as torch's add is) and returns the norm of the sum: the pre-norm block's "h = h + sublayer;
  normed = norm(h)" in one step.
- `linear` takes a `LinearWeight` and dispatches on its format; both take `DenseWeight`,
  `BlockQuantWeight` and `StackedWeight` (its parts' products side by side), and raise
  `UnsupportedWeightFormat` (naming the format) for any other. The output has x's dtype.
- `embed` gathers rows of an embedding table (dense or block-quantized; only the gathered rows
  are dequantized) into a dense [*ids.shape, hidden] tensor of the table's dtype.
- `qk_norm_rope` returns q [n, heads, head_dim] and k [n, kv_heads, head_dim]; they may be views of
  qkv (CpuLayerOps rotates in place, so qkv's q and k columns are overwritten) or new tensors.
  cos and sin of fewer than head_dim columns rotate only a head's first ones (partial rotary).
- `logits` is `linear` with fp32 outputs: the LM head.
- `moe_ffn` is a sparse mixture of experts' MLP (`nanoserve.model.moe`): x [T, H] contiguous,
  topk_ids int64 [T, k] in [0, E), topk_weights fp32 [T, k]; returns [T, H] in x's dtype,
  out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
  each expert's rows read once per call for all its tokens, experts no token chose not read.

`CpuLayerOps` is batch invariant: each row of every result (products, norms, rotary, the LM head's
fp32 logits) is the same bits whatever the other rows of the call, their number or the row's place
among them. The path of a product is chosen by the weight's format and x's dtype only, never by the
number of rows (a BLAS GEMM, or a GEMM on dequantized tiles, sums in another order than the C++
products, and would give a request's rows other values when more rows share its step).
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.nn.functional as F

from nanoserve.model.layers import apply_rope, rms_norm
from nanoserve.model.moe import grouped_moe_ffn
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, StackedWeight, dequantize
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight, UnsupportedWeightFormat
from nanoserve.native import DTYPE_SUFFIX, load_cpu_kernels


class LayerOps(Protocol):
    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor, table: LinearWeight) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def qk_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor, head: LinearWeight) -> torch.Tensor: ...

    def moe_ffn(self, x: torch.Tensor, gate: LinearWeight, up: LinearWeight, down: LinearWeight,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor: ...


class TorchLayerOps:
    """The reference, in torch calls."""

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear on the dense weight; a block-quantized one dequantized to x's dtype first."""
        if isinstance(w, DenseWeight):
            return F.linear(x, w.weight, bias)
        if isinstance(w, BlockQuantWeight):
            return F.linear(x, dequantize(w, x.dtype), bias)
        if isinstance(w, StackedWeight):
            out = torch.cat([self.linear(x, part) for part in w.parts], dim=-1)
            return out if bias is None else out + bias
        raise UnsupportedWeightFormat("TorchLayerOps", w.format)

    def embed(self, ids: torch.Tensor, table: LinearWeight) -> torch.Tensor:
        return embed_rows(ids, table)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            x = residual.add_(x)
        return rms_norm(x, weight, eps)

    def qk_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        n = qkv.shape[0]
        q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
        if q_weight is not None and k_weight is not None:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul(gate_up)

    def logits(self, x: torch.Tensor, head: LinearWeight) -> torch.Tensor:
        """The product in x's dtype, then fp32 (torch's GEMM rounds a bf16 product's outputs to
        bf16; widening the head instead would copy it at every step)."""
        return self.linear(x, head).float()

    def moe_ffn(self, x: torch.Tensor, gate: LinearWeight, up: LinearWeight, down: LinearWeight,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """`grouped_moe_ffn` on these products (each chosen expert's rows through `linear`)."""
        return grouped_moe_ffn(self, x, gate, up, down, topk_ids, topk_weights)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's gelu(gate) * up with the tanh approximation of GELU (transformers' gelu_pytorch_tanh),
    gate_up [..., 2 * inter] with the gate's columns first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class CpuLayerOps:
    """The C++ steps. Invariant: only contiguous CPU tensors of one dtype in `DTYPES` reach the
    library (`qk_norm_rope` works in place on the q and k columns of a contiguous qkv; cos and sin are
    [n, head_dim] as `rope_cos_sin` makes them): anything else raises ValueError before a pointer is
    passed, except in `linear` and `logits`, which hand what they do not take to `TorchLayerOps`,
    and in `qk_norm_rope`, which hands partial rotary (cos narrower than a head) to the torch
    reference."""

    DTYPES = frozenset(DTYPE_SUFFIX)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._linear = {dtype: getattr(lib, f"nanoserve_linear_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._norm = {dtype: getattr(lib, f"nanoserve_rms_norm_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._rope = {dtype: getattr(lib, f"nanoserve_qk_norm_rope_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._silu = {dtype: getattr(lib, f"nanoserve_silu_mul_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._quant_linear = {dtype: getattr(lib, f"nanoserve_quant_linear_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._dequantize_rows = {dtype: getattr(lib, f"nanoserve_dequantize_rows_{s}")
                                 for dtype, s in DTYPE_SUFFIX.items()}
        self._moe_ffn = {dtype: getattr(lib, f"nanoserve_moe_ffn_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        # The products with fp32 outputs, by x's dtype (fp32 x: the products above).
        self._linear_f32 = {**self._linear, torch.bfloat16: lib.nanoserve_linear_bf16_out_f32}
        self._quant_linear_f32 = {**self._quant_linear, torch.bfloat16: lib.nanoserve_quant_linear_bf16_out_f32}

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x w^T + bias in x's dtype: `_products` for 2-D contiguous x of a dtype in DTYPES with a
        weight and bias of that dtype (any number of rows); `TorchLayerOps.linear` otherwise. Raises
        `UnsupportedWeightFormat` for a format other than dense, block-quantized or stacked."""
        return self._products(x, w, bias, x.dtype)

    def logits(self, x: torch.Tensor, head: LinearWeight) -> torch.Tensor:
        """fp32 x head^T: for bf16 x the C++ products' fp32 sums, not rounded to bf16 first."""
        return self._products(x, head, None, torch.float32)

    def _products(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
        """The C++ products into a new [rows, out_features] tensor of `out_dtype` (x's dtype or fp32):
        linear.cpp for a dense weight, quant.cpp (int8 products on the blocks) for a block-quantized
        one, each part of a StackedWeight into its columns; the reference for what they do not take."""
        if not isinstance(w, DenseWeight | BlockQuantWeight | StackedWeight):
            raise UnsupportedWeightFormat("CpuLayerOps", w.format)
        parts = w.parts if isinstance(w, StackedWeight) else [w]
        if (x.dim() != 2 or x.dtype not in self.DTYPES or not x.is_contiguous()
                or any(isinstance(p, DenseWeight) and (p.weight.dtype != x.dtype or not p.weight.is_contiguous())
                       for p in parts)
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return TorchLayerOps().linear(x, w, bias).to(out_dtype)
        dense, quant = ((self._linear, self._quant_linear) if out_dtype == x.dtype
                        else (self._linear_f32, self._quant_linear_f32))
        out = torch.empty(x.shape[0], w.out_features, dtype=out_dtype)
        rows, threads = x.shape[0], torch.get_num_threads()
        offset = 0
        for part in parts:
            cols = slice(offset, offset + part.out_features)
            part_bias = None if bias is None else bias[cols].data_ptr()
            if isinstance(part, BlockQuantWeight):
                quant[x.dtype](x.data_ptr(), part.blocks.data_ptr(), int(BLOCK_FORMATS[part.format].qtype), part_bias,
                               out[:, cols].data_ptr(), out.shape[1], rows, part.out_features, part.in_features,
                               threads)
            elif not isinstance(part, DenseWeight):
                raise UnsupportedWeightFormat("CpuLayerOps", part.format)
            elif len(parts) == 1:
                dense[x.dtype](x.data_ptr(), part.weight.data_ptr(), part_bias, out.data_ptr(), rows,
                               part.out_features, part.in_features, threads)
            else:  # linear.cpp writes whole rows: a dense part's columns go through a buffer
                columns = torch.empty(rows, part.out_features, dtype=out_dtype)
                dense[x.dtype](x.data_ptr(), part.weight.data_ptr(), part_bias, columns.data_ptr(), rows,
                               part.out_features, part.in_features, threads)
                out[:, cols] = columns
            offset += part.out_features
        return out

    def moe_ffn(self, x: torch.Tensor, gate: LinearWeight, up: LinearWeight, down: LinearWeight,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' SwiGLU of x [T, H], weighted: out[t] = sum_j topk_weights[t, j] *
        down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j], with gate, up [E * I, H] and
        down [E * H, I] the experts stacked by rows. moe.cpp in one call when all three are
        block-quantized (each in its own format) and x is a contiguous [T, H] tensor of a dtype in
        DTYPES (ValueError otherwise): tokens grouped by expert, only the chosen experts read, each
        token's row the same bits whatever the other tokens (batch invariant). Other weights (dense
        experts) go through `grouped_moe_ffn` on this class's products (batch invariant too).
        Raises ValueError for shapes that do not fit, IndexError for an id outside [0, E)."""
        experts = _check_moe_shapes(x, gate, up, down, topk_ids, topk_weights)
        if not (isinstance(gate, BlockQuantWeight) and isinstance(up, BlockQuantWeight)
                and isinstance(down, BlockQuantWeight)):
            return grouped_moe_ffn(self, x, gate, up, down, topk_ids, topk_weights)
        _check(x)
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        tokens, k = ids.shape
        done = self._moe_ffn[x.dtype](
            x.data_ptr(), gate.blocks.data_ptr(), int(BLOCK_FORMATS[gate.format].qtype), up.blocks.data_ptr(),
            int(BLOCK_FORMATS[up.format].qtype), down.blocks.data_ptr(), int(BLOCK_FORMATS[down.format].qtype),
            ids.data_ptr(), weights.data_ptr(), out.data_ptr(), tokens, k, experts, gate.in_features,
            down.in_features, torch.get_num_threads())
        if done == -1:
            raise IndexError(f"moe_ffn: an expert id outside [0, {experts})")
        if done != 1:
            raise UnsupportedWeightFormat("moe.cpp", f"{gate.format}/{up.format}/{down.format}")
        return out

    def embed(self, ids: torch.Tensor, table: LinearWeight) -> torch.Tensor:
        """Rows of a block-quantized table dequantized by quant.cpp (ids out of range raise
        IndexError); `embed_rows` for the rest."""
        if not (isinstance(table, BlockQuantWeight) and table.dtype in self.DTYPES):
            return embed_rows(ids, table)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], table.in_features, dtype=table.dtype)
        if self._dequantize_rows[table.dtype](
                table.blocks.data_ptr(), int(BLOCK_FORMATS[table.format].qtype), table.out_features,
                table.in_features, flat.data_ptr(), flat.shape[0], out.data_ptr(), torch.get_num_threads()) != 1:
            raise IndexError("embed: a token id outside the table")
        return out.reshape(*ids.shape, table.in_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        _check(x, weight, *(() if residual is None else (residual,)))
        out = torch.empty_like(x)
        dim = x.shape[-1]
        self._norm[x.dtype](x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads())
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if cos.shape[-1] != head_dim:  # partial rotary: the C++ step rotates whole heads only
            return TorchLayerOps().qk_norm_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_weight, k_weight,
                                                eps)
        norms = () if q_weight is None or k_weight is None else (q_weight, k_weight)
        _check(qkv, cos, sin, *norms)
        n, stride = qkv.shape
        if stride < (num_heads + num_kv_heads) * head_dim or cos.numel() != n * head_dim or sin.numel() != cos.numel():
            raise ValueError("qk_norm_rope: qkv rows shorter than the q and k heads, or cos/sin not [n, head_dim]")
        self._rope[qkv.dtype](qkv.data_ptr(), n, stride, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
                              sin.data_ptr(), norms[0].data_ptr() if norms else None,
                              norms[1].data_ptr() if norms else None, eps, torch.get_num_threads())
        q = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(n, num_kv_heads, head_dim)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        _check(gate_up)
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        self._silu[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter,
                                  torch.get_num_threads())
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """In torch (no C++ step of its own yet): `gelu_tanh_mul`."""
        return gelu_tanh_mul(gate_up)


def embed_rows(ids: torch.Tensor, table: LinearWeight) -> torch.Tensor:
    """The rows `ids` of `table` [*ids.shape, in_features] in the table's dtype: gathered from a
    dense table, dequantized from the gathered blocks of a block-quantized one."""
    if isinstance(table, DenseWeight):
        return F.embedding(ids, table.weight)
    if isinstance(table, BlockQuantWeight):
        rows = dequantize(table.rows[ids.reshape(-1)], table.dtype)
        return rows.reshape(*ids.shape, table.in_features)
    raise UnsupportedWeightFormat("embed", table.format)


def _check_moe_shapes(x: torch.Tensor, gate: LinearWeight, up: LinearWeight, down: LinearWeight,
                      topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
    """The number of experts E of stacked gate, up [E * I, H] and down [E * H, I] for x [T, H] and
    topk_ids, topk_weights [T, k]; ValueError naming what does not fit."""
    hidden, inter = gate.in_features, down.in_features
    experts = gate.out_features // inter if inter else 0
    if (experts < 1 or gate.shape != up.shape or gate.out_features != experts * inter
            or down.out_features != experts * hidden):
        raise ValueError(f"moe_ffn: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)} are not "
                         "experts stacked as [E * I, H], [E * I, H], [E * H, I]")
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"moe_ffn: x {list(x.shape)} is not [tokens, {hidden}]")
    if (topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]
            or topk_ids.dtype.is_floating_point or not topk_weights.dtype.is_floating_point):
        raise ValueError(f"moe_ffn: topk_ids {topk_ids.dtype} {list(topk_ids.shape)} and topk_weights "
                         f"{topk_weights.dtype} {list(topk_weights.shape)} are not integer and float [{x.shape[0]}, k]")
    return experts


def _check(first: torch.Tensor, *others: torch.Tensor) -> None:
    """Raises ValueError unless every tensor is a contiguous CPU tensor of first's dtype, one the
    library has a build for."""
    dtype = first.dtype
    if dtype not in CpuLayerOps.DTYPES:
        raise ValueError(f"the fused CPU layer ops have no build for {dtype}")
    for t in (first, *others):
        if not (t.is_cpu and t.dtype == dtype and t.is_contiguous()):
            raise ValueError("the fused CPU layer ops take contiguous CPU tensors of one dtype")


def select_layer_ops(attention_backend: str, device: torch.device, dtype: torch.dtype) -> LayerOps:
    """CpuLayerOps on the CPU for fp32 and bf16 models whenever the attention backend is 'auto' or
    'cpu' and the kernel library builds; TorchLayerOps otherwise ('torch' is the pure-PyTorch path)."""
    if device.type == "cpu" and dtype in CpuLayerOps.DTYPES and attention_backend in ("auto", "cpu"):
        lib = load_cpu_kernels()
        if lib is not None:
            return CpuLayerOps(lib)
    return TorchLayerOps()
