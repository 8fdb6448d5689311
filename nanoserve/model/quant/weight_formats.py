"""Linear weights as objects that carry their storage format.

A decoder's matrix products (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, the LM head, and the
embedding table, which a tied LM head multiplies) hold a `LinearWeight`, not a bare tensor.
`LayerOps.linear(x, w, bias)` dispatches on the weight's class (one `isinstance` per call) and
raises `UnsupportedWeightFormat` for a format it has no product for; the native decoder refuses such
a model when it is built. A new format (GGUF Q8_0 / Q4_K blocks, int8 with per-row scales) is a
subclass here plus a branch with its kernel in each `LayerOps` that takes it; the decoder and the
loader stay as they are.

The loader writes checkpoint tensors through `WeightDestination`s: the weight itself (`w.copy_(t)`)
or a slice of its rows (`w[lo:hi].copy_(t)`, for the fused q/k/v and gate/up matrices), each of
which converts the dense checkpoint rows into the weight's format.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn


class WeightDestination(Protocol):
    """Where the loader writes one checkpoint tensor: a dense [rows, in_features] block of values,
    checked against `shape`, then stored (converted to the destination's format) by `copy_`. A
    torch.Tensor is one (norm weights, biases, a dense weight's row slices)."""

    @property
    def shape(self) -> torch.Size: ...

    def copy_(self, src: torch.Tensor) -> object: ...


class UnsupportedWeightFormat(ValueError):
    """A computation met a weight in a format it has no kernel for."""

    def __init__(self, where: str, fmt: str) -> None:
        super().__init__(f"{where} has no matrix product for weight format {fmt!r}")
        self.format = fmt


class LinearWeight(nn.Module):
    """The weight W of y = x W^T, stored in one format. Invariants:

    - Logically W is [out_features, in_features] (`shape`), rows being output features, whatever
      the storage; a format stores a row's values (or blocks of them) together, so any slice of
      rows is a destination the loader can write on its own (`__getitem__`).
    - `format` names the storage: "dense" for a plain tensor of the model's dtype, "stacked" for
      row ranges in formats of their own; block-quantized weights name their block layout (as GGUF
      names its tensor types, `nanoserve.model.quant.block_quant`).
    - The storage is this module's parameters or buffers, created at construction (on the
      current default device) and filled in place by the loader, so `model.parameters()`,
      `.to()` and memory accounting see it. Once the engine is built it never moves: the native
      decoder holds its addresses.
    """

    format: str

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.in_features = in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __getitem__(self, rows: slice) -> WeightDestination:
        """The destination of rows `rows` (a slice with step 1) of W; each format defines it."""
        raise NotImplementedError

    def copy_(self, src: torch.Tensor) -> LinearWeight:
        """Stores the dense [out_features, in_features] `src` in this format."""
        self[0:self.out_features].copy_(src)
        return self

    def extra_repr(self) -> str:
        return f"{self.format}, out_features={self.out_features}, in_features={self.in_features}"


class DenseWeight(LinearWeight):
    """W as one contiguous [out_features, in_features] tensor of the model's dtype (`weight`): the
    layout of `nn.Linear` and of checkpoints, which the products read in place (the transposed
    layout is slower in bf16)."""

    format = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        """Wraps `weight` [out, in] (shared, not copied)."""
        super().__init__(*weight.shape)
        # Registered directly (nn.Module.__setattr__ would refuse the name of the property below).
        self._parameters["weight"] = nn.Parameter(weight, requires_grad=False)

    @property
    def weight(self) -> nn.Parameter:
        """The registered parameter "weight", read without nn.Module.__getattr__'s fallback, as
        `LayerOps.linear` does on every product; whatever `.to()` puts there."""
        return cast(nn.Parameter, self._parameters["weight"])

    @classmethod
    def empty(cls, out_features: int, in_features: int, dtype: torch.dtype) -> DenseWeight:
        """An uninitialised weight, for the loader to fill."""
        return cls(torch.empty(out_features, in_features, dtype=dtype))

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.weight[rows]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.weight.dtype}"
