"""Weight loading: Hugging Face tensor names onto the fused parameters of `CausalLM`.

q/k/v projections land in row slices of `qkv_proj`, gate/up in row slices of `gate_up_proj`. Each
destination is a `WeightDestination`: a tensor (norms, biases) or a `LinearWeight` or a slice of its
rows, which stores the checkpoint's dense rows in its own format.
Invariant after `load_weights` returns: every parameter slice was written exactly by the
checkpoint, or a `MissingWeightsError` named what was absent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch

from nanoserve.model.decoder import CausalLM
from nanoserve.model.weight_formats import WeightDestination

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class MissingWeightsError(ValueError):
    """The checkpoint lacks tensors the model needs, or has them in the wrong shape."""


def _target(model: CausalLM, name: str) -> tuple[WeightDestination, str] | None:
    """Maps an HF tensor name to (destination view, key used to track coverage)."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, "embed_tokens"
    if name == "model.norm.weight":
        return model.norm.weight, "norm"
    if name == "lm_head.weight":
        return (model.lm_head, "lm_head") if model.lm_head is not None else None
    m = _LAYER.match(name)
    if m is None:
        return None
    layer = model.layers[int(m.group(1))]
    attn, mlp, rest = layer.self_attn, layer.mlp, m.group(2)
    q, kv = attn.q_size, attn.kv_size
    slices = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    direct: dict[str, WeightDestination | None] = {
        "self_attn.o_proj.weight": attn.o_proj,
        "input_layernorm.weight": layer.input_layernorm.weight,
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "mlp.down_proj.weight": mlp.down_proj,
        "self_attn.q_norm.weight": attn.q_norm.weight if attn.q_norm is not None else None,
        "self_attn.k_norm.weight": attn.k_norm.weight if attn.k_norm is not None else None,
    }
    if rest in direct:
        dest = direct[rest]
        return (dest, name) if dest is not None else None
    proj, _, kind = rest.removeprefix("self_attn.").partition(".")
    if proj in slices and rest.startswith("self_attn."):
        lo, hi = slices[proj]
        full = attn.qkv_proj if kind == "weight" else attn.qkv_bias
        return (full[lo:hi], name) if full is not None else None
    if rest == "mlp.gate_proj.weight":
        return mlp.gate_up_proj[: mlp.inter], name
    if rest == "mlp.up_proj.weight":
        return mlp.gate_up_proj[mlp.inter :], name
    return None


def expected_keys(model: CausalLM) -> set[str]:
    """The set of coverage keys a complete checkpoint must write."""
    keys = {"embed_tokens", "norm"} | ({"lm_head"} if model.lm_head is not None else set())
    per_layer = ["self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    if model.cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if model.cfg.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(model.cfg.num_hidden_layers):
        keys |= {f"model.layers.{i}.{p}" for p in per_layer}
    return keys


@torch.no_grad()
def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies checkpoint tensors (HF names) into the model, casting to the model's dtype (each
    destination converts to its format)."""
    seen: set[str] = set()
    for name, tensor in tensors:
        target = _target(model, name)
        if target is None:
            if not _IGNORED.search(name):
                log.warning("ignoring checkpoint tensor %s (not used by this model)", name)
            continue
        dest, key = target
        if dest.shape != tensor.shape:
            raise MissingWeightsError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        seen.add(key)
    missing = expected_keys(model) - seen
    if missing:
        raise MissingWeightsError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
