"""Weight loading: checkpoint tensors onto the fused parameters of `CausalLM`, by the names its
family declares (`nanoserve.model.families`).

q/k/v projections land in row slices of `qkv_proj`, gate/up in row slices of `gate_up_proj`, and
each expert's matrix of a mixture of experts in its rows of the stacked expert matrix (transformers'
fused expert tensors are first cut into per-expert ones: `per_expert`). Each
destination is a `WeightDestination`: a tensor (norms, biases) or a `LinearWeight` or a slice of its
rows, which stores the checkpoint's dense rows in its own format.
Invariant after `load_weights` returns: every parameter slice was written exactly by the
checkpoint (a norm weight of a family with `LayerShape.norm_offset` as offset + w, in fp32 before
the cast), or a `MissingWeightsError` named what was absent. The text decoder of a multimodal
checkpoint is read under its `Family.text_prefixes`; its other tensors are counted and skipped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from nanoserve.model.decoder import CausalLM, DecoderLayer
from nanoserve.model.families import Family, TensorName
from nanoserve.model.moe import SparseMoE
from nanoserve.model.quant.block_quant import BlockQuantWeight, BlockRows, QuantizedRows, dequantize
from nanoserve.model.quant.weight_formats import LinearWeight, WeightDestination

log = logging.getLogger(__name__)

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# transformers' fused expert layout: its MoE models' own parameter names, which
# `save_pretrained(save_original_format=False)` writes (per-expert tensors are its default).
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.)mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs, or has them in the wrong shape."""


def _rows(layer: DecoderLayer, block: str) -> slice:
    """The rows of a fused parameter of `layer` that one `TensorName.rows` block fills."""
    q, kv = layer.self_attn.q_size, layer.self_attn.kv_size
    inter = layer.dense_mlp.inter if block in ("gate", "up") else 0
    return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
            "gate": slice(0, inter), "up": slice(inter, 2 * inter)}[block]


def _destination(owner: nn.Module, tensor: TensorName, expert: int | None = None) -> WeightDestination | None:
    """The view of `owner` (the model, or a layer for a layer tensor) that `tensor` fills (for an
    `experts` tensor, expert `expert`'s rows), or None if this model has no such parameter (an LM
    head tied to the embedding, a bias it lacks, an MoE layer's tensor in a dense layer or the
    reverse). Raises MissingWeightsError for an expert the layer does not have."""
    dest: object = owner
    for attr in tensor.param.split("."):
        dest = getattr(dest, attr, None)
        if dest is None:
            return None
    assert isinstance(dest, torch.Tensor | LinearWeight), tensor.param
    if tensor.experts:
        assert isinstance(owner, DecoderLayer) and isinstance(owner.mlp, SparseMoE) and expert is not None
        num = owner.mlp.num_experts
        if not 0 <= expert < num:
            raise MissingWeightsError(f"tensor {tensor.hf.format(e=expert)} of expert {expert}: the layer has {num}")
        rows = dest.shape[0] // num
        return dest[expert * rows:(expert + 1) * rows]
    if tensor.rows is None:
        return dest
    assert isinstance(owner, DecoderLayer), tensor.param
    return dest[_rows(owner, tensor.rows)]


def _layer_names(layer: DecoderLayer, tensor: TensorName) -> list[tuple[str, int | None]]:
    """The (name relative to the layer, expert) of each checkpoint tensor `tensor` stands for in
    `layer`: one per expert for an `experts` tensor of an MoE layer, else the one."""
    if tensor.experts and isinstance(layer.mlp, SparseMoE):
        return [(tensor.hf.format(e=e), e) for e in range(layer.mlp.num_experts)]
    return [(tensor.hf, None)]


def _hf_name(family: Family, name: str) -> str:
    """The name as a `*ForCausalLM` checkpoint writes it: one saved from the bare decoder (a
    `*Model`, as embedding models such as Qwen3-Embedding are) lacks the `model.` prefix, and a
    multimodal one nests its text decoder under one of the family's `text_prefixes`."""
    causal = family.causal_name(name)
    if causal != name:
        return causal
    if family.tensor_by_hf(name) is None and family.tensor_by_hf("model." + name) is not None:
        return "model." + name
    return name


def _target(model: CausalLM, family: Family, name: str) -> WeightDestination | None:
    """The destination view of a Hugging Face tensor name, or None if the model has no use for it."""
    ref = family.tensor_by_hf(name)
    if ref is None:
        return None
    return _destination(model if ref.layer is None else model.layers[ref.layer], ref.tensor, ref.expert)


def expected_keys(model: CausalLM, family: Family) -> set[str]:
    """The Hugging Face names a complete checkpoint must hold: every tensor of `family` that has a
    destination in `model`."""
    keys = {t.hf for t in family.global_tensors if _destination(model, t) is not None}
    for i, layer in enumerate(model.layers):
        keys |= {f"model.layers.{i}.{name}" for t in family.layer_tensors for name, e in _layer_names(layer, t)
                 if _destination(layer, t, e) is not None}
    return keys


def expected_shapes(model: CausalLM, family: Family) -> dict[str, tuple[int, ...]]:
    """Every tensor a complete checkpoint of `model` holds (`expected_keys`), Hugging Face name to
    shape, in checkpoint order: the embedding, each layer's tensors as `family` declares them, the
    final norm and (untied) LM head. `model` may live on the meta device."""
    def shape(owner: nn.Module, t: TensorName, expert: int | None = None) -> tuple[int, ...] | None:
        dest = _destination(owner, t, expert)
        return None if dest is None else tuple(dest.shape)

    shapes = {t.hf: s for t in family.global_tensors[:1] if (s := shape(model, t)) is not None}
    for i, layer in enumerate(model.layers):
        shapes |= {f"model.layers.{i}.{name}": s for t in family.layer_tensors for name, e in _layer_names(layer, t)
                   if (s := shape(layer, t, e)) is not None}
    return shapes | {t.hf: s for t in family.global_tensors[1:] if (s := shape(model, t)) is not None}


def per_expert(family: Family, tensors: Iterable[tuple[str, torch.Tensor | QuantizedRows]]
               ) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """The tensors, with transformers' fused expert layout (`mlp.experts.gate_up_proj` [E, 2I, H],
    gate rows first within each expert, `mlp.experts.down_proj` [E, H, I], the router
    `mlp.gate.weight`) given as the family's own per-expert tensors (views); every other tensor
    as it is."""
    for name, tensor in tensors:
        m = _FUSED_EXPERTS.match(name)
        if m is None or family.moe is None or family.tensor_by_hf(name) is not None or not isinstance(
                tensor, torch.Tensor):
            yield name, tensor
            continue
        prefix, kind = m.groups()
        hf = {t.param: t.hf for t in family.layer_tensors}
        if kind == "gate.weight":
            yield prefix + hf["mlp.router"], tensor
        elif kind == "experts.down_proj":
            for e in range(tensor.shape[0]):
                yield prefix + hf["mlp.down_exps"].format(e=e), tensor[e]
        else:
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield prefix + hf["mlp.gate_exps"].format(e=e), tensor[e, :inter]
                yield prefix + hf["mlp.up_exps"].format(e=e), tensor[e, inter:]


@torch.no_grad()
def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantizedRows]], family: Family) -> None:
    """Copies checkpoint tensors (Hugging Face names of `family`) into the model: each destination
    converts dense values to its format (casting to the model's dtype, or quantizing) and takes
    `QuantizedRows` of its own block format as they are; a dense destination dequantizes them."""
    seen: set[str] = set()
    not_text = 0
    for given, tensor in per_expert(family, tensors):
        name = _hf_name(family, given)
        ref = family.tensor_by_hf(name)
        dest = _target(model, family, name)
        if dest is None or ref is None:
            if family.text_prefixes and given == name and ref is None:
                not_text += 1  # a multimodal checkpoint's vision tower or projector
            elif not _IGNORED.search(name):
                log.warning("ignoring checkpoint tensor %s (not used by this model)", name)
            continue
        if dest.shape != tensor.shape:
            raise MissingWeightsError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if isinstance(tensor, QuantizedRows):
            _copy_blocks(dest, tensor, model.dtype)
        elif family.layer.norm_offset and ref.tensor.param.endswith("norm.weight"):
            dest.copy_(tensor.float() + family.layer.norm_offset)
        else:
            dest.copy_(tensor)
        seen.add(name)
    if not_text:
        log.info("skipped %d tensors outside the text decoder (%s reads text only)", not_text, family.name)
    missing = expected_keys(model, family) - seen
    if missing:
        raise MissingWeightsError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _copy_blocks(dest: WeightDestination, rows: QuantizedRows, dtype: torch.dtype) -> None:
    """Writes raw blocks into `dest`: byte for byte into block-quantized rows (which must be of
    their format), dequantized to `dtype` into any other destination."""
    if isinstance(dest, BlockQuantWeight):
        dest = dest[0:dest.out_features]
    if isinstance(dest, BlockRows):
        dest.copy_(rows)
    else:
        dest.copy_(dequantize(rows, dtype))
