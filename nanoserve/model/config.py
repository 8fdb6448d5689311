"""Model configuration: one frozen description of a decoder, read from a Hugging Face `config.json`.

The supported families (`nanoserve.model.families`) share one decoder and differ only in the
switches recorded here: bias on q/k/v, RMSNorm on q and k (per head or over the projection), where
the norms sit, the MLP's activation, scaled embeddings, the attention scale, per-layer sliding
windows and rotary bases, a final logit softcap, tied embeddings and the rotary scaling rule. How a
family's config.json sets them is the family's declaration; anything outside that set fails at
load with a message that names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from nanoserve.model.families import FAMILIES, Family, FamilyRegistry
from nanoserve.model.families.family import ACTIVATIONS

log = logging.getLogger(__name__)



class ModelLoadError(RuntimeError):
    """The model could not be found or read; the message is one line meant for the user."""


class UnsupportedModelError(ValueError):
    """A checkpoint asks for an architecture or a setting this decoder does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary scaling rule. `rope_type` is one of `families.ROPE_TYPES`; the other fields matter per type."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and switches of one decoder-only transformer.

    Invariants: `num_attention_heads % num_key_value_heads == 0`; `head_dim` is explicit (it need
    not equal hidden_size / num_attention_heads, as in Qwen3). `family` names a `Family` of the
    registry the config was read with; `native_decoder` is that family's flag. `layer_windows` is
    empty or has one entry per layer: the window of a local layer (a query at position p attends
    to positions > p - window), None for a global one; local layers rotate by `local_rope_theta`
    without scaling. `sliding_window` is a window over every layer that the engine does not
    implement (it caps the context instead; Mistral, Qwen under `use_sliding_window`).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    native_decoder: bool = True
    norms: str = "pre"  # `LayerShape.norms`
    qk_norm_over: str = "head"  # `LayerShape.qk_norm_over`
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # the embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # scores are q.k times this; None: head_dim**-0.5
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * h * self.intermediate_size
        heads = self.num_attention_heads + self.num_key_value_heads
        qk_norms = heads * d if self.qk_norm_over == "projection" else 2 * d
        norms = (4 if self.norms == "sandwich" else 2) * h + (qk_norms if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + mlp + norms) + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], families: FamilyRegistry = FAMILIES) -> ModelConfig:
        """Builds a config from a parsed `config.json`, by the rules of its family in `families`;
        raises UnsupportedModelError on anything this decoder would compute differently from the
        reference."""
        family = families.for_hf_config(cfg)
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {cfg.get('architectures') or cfg.get('model_type')!r}; "
                f"nanoserve supports {families.architectures}"
            )
        if family.text_prefixes and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures"),
                   **{k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg and k not in cfg["text_config"]}}
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in family.activations:
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; nanoserve implements "
                                        f"{list(family.activations)} for {family.name}")
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError(f"unsupported config field attn_logit_softcapping="
                                        f"{cfg['attn_logit_softcapping']} (nanoserve does not softcap attention "
                                        "scores)")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("unsupported config field use_bidirectional_attention=true")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("unsupported config field mlp_bias=true")
        if family.bias_switch is not None and cfg.get(family.bias_switch):
            raise UnsupportedModelError(
                f"unsupported config field {family.bias_switch}=true ({family.name} then has a bias on "
                "o_proj, which nanoserve does not implement)"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rope = cfg.get("rope_parameters") or {}
        local_rope = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention", rope)
        legacy = cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = _rope_scaling({**legacy, **rope}, family)
        shape = family.layer
        windows: tuple[int | None, ...] = ()
        local_theta = None
        if shape.interleaved_windows:
            windows = _layer_windows(cfg)
            if local_rope.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"unsupported rope type {local_rope['rope_type']!r} for local layers")
            local_theta = float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        scalar = cfg.get("query_pre_attn_scalar")
        switch = family.sliding_window_switch
        window = cfg.get("sliding_window") if switch is None or cfg.get(switch) else None
        if shape.interleaved_windows:
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            family=family.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_scaling=scaling,
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            native_decoder=family.native_decoder,
            norms=shape.norms,
            qk_norm_over=shape.qk_norm_over,
            hidden_act=ACTIVATIONS[act],
            embed_scale=hidden**0.5 if shape.embed_scale else None,
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            layer_windows=windows,
            local_rope_theta=local_theta,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
        )


def _layer_windows(cfg: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window from config.json's `layer_types` ("sliding_attention" or "full_attention"),
    or else from `sliding_window_pattern` (every pattern-th layer global; 6 by default, as
    transformers reads Gemma 3)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
        for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise UnsupportedModelError(f"unsupported layer_types {types!r}")
    window = cfg.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise UnsupportedModelError("config.json has sliding_attention layers but no sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope_scaling(spec: dict[str, Any], family: Family) -> RopeScaling:
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type not in family.rope_types:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r}; nanoserve supports {list(family.rope_types)} "
            f"for {family.name}"
        )
    known = {f for f in RopeScaling.__slots__ if f != "rope_type"}
    return RopeScaling(rope_type=rope_type, **{k: v for k, v in spec.items() if k in known})
