"""The computations of a decoder layer behind one interface: the matrix products, RMSNorm with the
residual add before it, per-head q/k RMSNorm with rotary embedding, SwiGLU's silu(gate) * up and
GeGLU's gelu_tanh(gate) * up.

`TorchLayerOps` is the reference: F.linear and the Hugging Face numerics of
`nanoserve.model.layers`, on any device, capturable in CUDA graphs. `CpuLayerOps` runs the same
steps through nanoserve's C++ (`nanoserve/csrc/`): each elementwise step one call where torch makes
3-15 (most of an RMSNorm of one row in torch is the Python around its seven calls), and the products
of a few rows (fp32, and bf16 on CPUs with AVX512-BF16) or of any number (bf16 elsewhere) through
`linear.cpp`, which reads each row of the weight once for all rows of x.

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
"""

from __future__ import annotations

import ctypes
from typing import Protocol

import torch
import torch.nn.functional as F

from nanoserve.model.layers import apply_rope, rms_norm
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


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU's gelu(gate) * up with the tanh approximation of GELU (transformers' gelu_pytorch_tanh),
    gate_up [..., 2 * inter] with the gate's columns first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# CpuLayerOps.linear's C++ product takes fp32 inputs of up to SMALL_M rows (MKL's GEMM is faster
# beyond), and bf16 inputs of up to NATIVE_BF16_M rows where the library multiplies bf16 natively
# (AVX512-BF16; torch's oneDNN GEMM then does too and overtakes it in a few dozen rows, but up to
# NATIVE_BF16_M a step through NativeDecoder saves more than that) or of any number where it does
# not (torch's bf16 GEMM is then emulated, slower at every size). docs/architecture.md ("Runner and
# sampler") explains both cuts and points to the measurements behind them.
SMALL_M = 16
NATIVE_BF16_M = 32
# Block-quantized weights take the same cuts (up to them quant.cpp's int8 products, beyond them
# torch's GEMM on tiles of the weight dequantized to the model's dtype, each of this many bytes: a
# tile stays in L2 while the GEMM reads it), except bf16 x on CPUs with AMX: quant.cpp multiplies any
# number of rows there, in AMX tiles from `nanoserve_quant_amx_rows` rows on.
TILE_BYTES = 1 << 20


class CpuLayerOps:
    """The C++ steps. Invariant: only contiguous CPU tensors of one dtype in `DTYPES` reach the
    library (`qk_norm_rope` works in place on the q and k columns of a contiguous qkv; cos and sin are
    [n, head_dim] as `rope_cos_sin` makes them): anything else raises ValueError before a pointer is
    passed, except in `linear`, which hands what it does not take to F.linear, and in `qk_norm_rope`,
    which hands partial rotary (cos narrower than a head) to the torch reference."""

    DTYPES = frozenset(DTYPE_SUFFIX)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        # The most rows of x each dtype's products take here (None: any); F.linear takes the rest.
        self.max_rows: dict[torch.dtype, int | None] = {
            torch.float32: SMALL_M, torch.bfloat16: NATIVE_BF16_M if lib.nanoserve_linear_bf16_native() else None}
        # The same for products with block-quantized weights (the rest: dequantized tiles).
        self.quant_max_rows: dict[torch.dtype, int | None] = {
            **self.max_rows, **({torch.bfloat16: None} if lib.nanoserve_quant_amx_rows() else {})}
        self._linear = {dtype: getattr(lib, f"nanoserve_linear_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._norm = {dtype: getattr(lib, f"nanoserve_rms_norm_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._rope = {dtype: getattr(lib, f"nanoserve_qk_norm_rope_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._silu = {dtype: getattr(lib, f"nanoserve_silu_mul_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._quant_linear = {dtype: getattr(lib, f"nanoserve_quant_linear_{s}") for dtype, s in DTYPE_SUFFIX.items()}
        self._dequantize_rows = {dtype: getattr(lib, f"nanoserve_dequantize_rows_{s}")
                                 for dtype, s in DTYPE_SUFFIX.items()}

    def linear(self, x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """For a `DenseWeight`: the C++ product for 2-D contiguous x of one dtype with its weight and
        bias, of at most `max_rows[dtype]` rows; F.linear otherwise. Block-quantized and stacked
        weights: `_quantized_linear`. Other formats raise `UnsupportedWeightFormat`."""
        if isinstance(w, BlockQuantWeight | StackedWeight):
            return self._quantized_linear(x, w, bias)
        if not isinstance(w, DenseWeight):
            raise UnsupportedWeightFormat("CpuLayerOps", w.format)
        weight = w.weight
        limit = self.max_rows.get(x.dtype)
        if (x.dim() != 2 or x.dtype not in self.DTYPES or weight.dtype != x.dtype
                or (limit is not None and x.shape[0] > limit)
                or not (x.is_contiguous() and weight.is_contiguous())
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return F.linear(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        self._linear[x.dtype](x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads())
        return out

    def _quantized_linear(self, x: torch.Tensor, w: BlockQuantWeight | StackedWeight,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """For 2-D contiguous x of a dtype in DTYPES (bias of that dtype): of at most
        `quant_max_rows[dtype]` rows, quant.cpp's product on the blocks (int8 dot products, or AMX
        tiles of W dequantized); of more, where
        a dense weight would go to torch's GEMM, that GEMM on tiles of W dequantized by quant.cpp
        (`TILE_BYTES` each; the GEMM then outruns the int8 products by more than the dequantizing
        costs). Each part of a StackedWeight writes its columns of one output (a dense part through
        `linear`). Other x take the reference (dequantize, then F.linear)."""
        if (x.dim() != 2 or x.dtype not in self.DTYPES or not x.is_contiguous()
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return TorchLayerOps().linear(x, w, bias)
        limit = self.quant_max_rows.get(x.dtype)
        tiled = limit is not None and x.shape[0] > limit
        out = x.new_empty(x.shape[0], w.out_features)
        offset = 0
        for part in w.parts if isinstance(w, StackedWeight) else [w]:
            cols = slice(offset, offset + part.out_features)
            part_bias = None if bias is None else bias[cols]
            if isinstance(part, BlockQuantWeight) and tiled:
                self._tiled_linear(x, part, part_bias, out[:, cols])
            elif isinstance(part, BlockQuantWeight):
                self._quant_linear[x.dtype](
                    x.data_ptr(), part.blocks.data_ptr(), int(BLOCK_FORMATS[part.format].qtype),
                    None if part_bias is None else part_bias.data_ptr(), out[:, cols].data_ptr(), out.shape[1],
                    x.shape[0], part.out_features, part.in_features, torch.get_num_threads())
            else:
                out[:, cols] = self.linear(x, part, part_bias)
            offset += part.out_features
        return out

    def _tiled_linear(self, x: torch.Tensor, w: BlockQuantWeight, bias: torch.Tensor | None,
                      out: torch.Tensor) -> None:
        """out (columns of a wider output) = x w^T + bias through F.linear on tiles of w's rows
        dequantized to x's dtype."""
        rows = max(1, TILE_BYTES // (w.in_features * x.element_size()))
        tile = x.new_empty(min(rows, w.out_features), w.in_features)
        qtype = int(BLOCK_FORMATS[w.format].qtype)
        for lo in range(0, w.out_features, rows):
            n = min(rows, w.out_features - lo)
            self._dequantize_rows[x.dtype](w.blocks[lo].data_ptr(), qtype, n, w.in_features, None, n,
                                           tile.data_ptr(), torch.get_num_threads())
            out[:, lo:lo + n] = F.linear(x, tile[:n], None if bias is None else bias[lo:lo + n])

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
