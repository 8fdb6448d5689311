"""Which storage format each matrix of a decoder gets, decided before the model is built.

vLLM hands a model's constructor a quantization config that picks each layer's method; ours is
that idea reduced to a table. `QuantConfig.formats` maps a matrix, or a block of rows of a fused
one (q/k/v of `qkv_proj`, gate/up of `gate_up_proj`), to a block format of
`nanoserve.model.quant.block_quant.BLOCK_FORMATS`. It is made from the tensor types of a GGUF file
(`from_tensor_formats`: the file decides) or from `--quantization` for a dense checkpoint
(`for_layers`), and `CausalLM` reads it when it creates its weights (`make_weight`).

Invariants:
- A key is a `WeightKey`: the layer (None for the embedding and LM head), the parameter's attribute
  path and its row block, as the family declarations name them (`TensorName.param`, `.rows`).
- A value is a key of BLOCK_FORMATS; a matrix absent from `formats` is dense (a `DenseWeight` of
  the model's dtype). The empty config (`QuantConfig()`) is the dense model.
- A fused parameter whose blocks all have one format is one weight of that format; otherwise a
  `StackedWeight` whose parts are the runs of consecutive blocks sharing a format, so every block's
  rows lie within one part (the loader writes each block on its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

import torch

from nanoserve.model.families import MOE_TENSORS, Family
from nanoserve.model.families.family import DENSE_MLP_PARAMS
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, StackedWeight
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight

DENSE = "dense"
# The matrices of a decoder layer (`--quantization` quantizes these; norms, biases and an MoE
# layer's router stay dense): a dense MLP's, or a mixture of experts' stacked expert matrices.
EXPERT_MATRICES = tuple(t.param for t in MOE_TENSORS if t.experts)
LAYER_MATRICES = ("self_attn.qkv_proj", "self_attn.o_proj", *DENSE_MLP_PARAMS, *EXPERT_MATRICES)


class WeightKey(NamedTuple):
    """One matrix, or one row block of a fused matrix, of a decoder (see the module docstring)."""

    layer: int | None
    param: str
    rows: str | None = None


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The block format of every matrix that is not dense (see the module docstring)."""

    formats: Mapping[WeightKey, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        unknown = sorted(set(self.formats.values()) - set(BLOCK_FORMATS))
        if unknown:
            raise ValueError(f"unknown block formats {unknown}; known: {', '.join(BLOCK_FORMATS)}")

    @classmethod
    def from_tensor_formats(cls, family: Family, formats: Mapping[str, str]) -> QuantConfig:
        """The config of a checkpoint whose tensors (Hugging Face names of `family`) in `formats`
        are stored in those block formats; names the family does not know are skipped."""
        table: dict[WeightKey, str] = {}
        for name, fmt in formats.items():
            ref = family.tensor_by_hf(name)
            if ref is not None:
                table[WeightKey(ref.layer, ref.tensor.param, ref.tensor.rows)] = fmt
        return cls(MappingProxyType(table))

    @classmethod
    def for_layers(cls, fmt: str, family: Family, num_layers: int, moe_layers: tuple[int, ...] = ()) -> QuantConfig:
        """Every block of every `LAYER_MATRICES` matrix of `num_layers` layers in `fmt` (the expert
        matrices in `moe_layers`, the dense MLP's in the others); the embedding, LM head, norms,
        biases and routers dense."""
        def in_layer(param: str, layer: int) -> bool:
            return param not in (*DENSE_MLP_PARAMS, *EXPERT_MATRICES) or (param in EXPERT_MATRICES) == (
                layer in moe_layers)

        return cls(MappingProxyType({
            WeightKey(i, t.param, t.rows): fmt
            for i in range(num_layers) for t in family.layer_tensors
            if t.param in LAYER_MATRICES and in_layer(t.param, i)}))

    @property
    def used_formats(self) -> frozenset[str]:
        """The block formats some matrix has."""
        return frozenset(self.formats.values())

    def format(self, layer: int | None, param: str, rows: str | None = None) -> str:
        """The format of one matrix or row block: a BLOCK_FORMATS key, or DENSE. A row block takes
        its matrix's format where the checkpoint stores the matrix fused (key `rows` None)."""
        whole = self.formats.get(WeightKey(layer, param), DENSE)
        return self.formats.get(WeightKey(layer, param, rows), whole)

    def make_weight(self, layer: int | None, param: str, blocks: Sequence[tuple[str | None, int]],
                    in_features: int, dtype: torch.dtype) -> LinearWeight:
        """An empty weight for `param` of `layer`, made of `blocks` ((row block name or None,
        number of rows), top rows first) of `in_features` columns, each block in its format."""
        runs: list[tuple[str, int]] = []
        for rows, n in blocks:
            fmt = self.format(layer, param, rows)
            if runs and runs[-1][0] == fmt:
                runs[-1] = (fmt, runs[-1][1] + n)
            else:
                runs.append((fmt, n))
        parts = [_empty(fmt, n, in_features, dtype) for fmt, n in runs]
        return parts[0] if len(parts) == 1 else StackedWeight(parts)


def _empty(fmt: str, out_features: int, in_features: int, dtype: torch.dtype) -> LinearWeight:
    if fmt == DENSE:
        return DenseWeight.empty(out_features, in_features, dtype)
    return BlockQuantWeight.empty(fmt, out_features, in_features, dtype)

