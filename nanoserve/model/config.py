"""Model configuration: one frozen description of a decoder, read from a Hugging Face `config.json`.

The supported families (`nanoserve.model.families`) share one decoder and differ only in the
switches recorded here: bias on q/k/v, RMSNorm on q and k (per head or over the projection), where
the norms sit, the MLP's activation, per-layer sliding windows and rotary bases, tied embeddings,
the rotary scaling rule, partial rotary, rotary-free layers, scalar multipliers on the embedding,
the residual adds, the attention scores and the logits, and a final logit softcap. How a family's
config.json sets them is the family's declaration; anything outside that set fails at load with a
message that names it.
"""

from __future__ import annotations

import logging
import math
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
    # longrope: per-frequency divisors for contexts within / past the original one, and the factor
    # cos and sin are multiplied by (`from_hf_dict` resolves it as transformers does: config.json's
    # attention_factor, else sqrt(1 + ln(s) / ln(original)) for s = `factor`, or the model's context
    # over the original one, when above 1).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None


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
    partial_rotary_factor: float = 1.0
    # Scalar multipliers: of the embedding (Granite's embedding_multiplier, Gemma's
    # sqrt(hidden_size)), of each sublayer's output before its residual add (Granite), of q.k
    # (None: head_dim ** -0.5; Granite's attention_multiplier, Gemma's query_pre_attn_scalar ** -0.5),
    # and the divisor of the logits (Granite).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary (SmolLM3)
    norms: str = "pre"  # `LayerShape.norms`
    qk_norm_over: str = "head"  # `LayerShape.qk_norm_over`
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap), after logits_scaling
    # Sparse mixture of experts (`nanoserve.model.moe`) in `moe_layers` (the other layers' MLPs are
    # dense, of `intermediate_size`): `num_experts` experts of width `moe_intermediate_size`,
    # `num_experts_per_tok` per token, the top-k weights renormalised under `norm_topk_prob` and
    # rounded to the model's dtype under `moe_weights_in_dtype`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_weights_in_dtype: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """The factor of q.k in attention."""
        return self.head_dim**-0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def longrope_long(self) -> bool:
        """Whether LongRoPE takes its long factors, for every position: when the model's context
        exceeds the original one (as llama.cpp decides by its context size; the engine decides by
        its max_model_len instead, `CausalLM.use_context`). transformers switches
        per forward pass, by that pass's longest sequence, so a prompt within the original context
        of such a model gets its short factors there, and K/V cached before a sequence crossed the
        original length keep them; a KV cache holds one rotation per position, so here it is one
        rule per model."""
        return self.max_position_embeddings > self.rope_scaling.original_max_position_embeddings

    @property
    def rope_attention_factor(self) -> float:
        """The factor of cos and sin (1 except under LongRoPE)."""
        s = self.rope_scaling
        return s.attention_factor if s.rope_type == "longrope" and s.attention_factor is not None else 1.0

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * h * self.intermediate_size
        moe = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts and router
        heads = self.num_attention_heads + self.num_key_value_heads
        qk_norms = heads * d if self.qk_norm_over == "projection" else 2 * d
        norms = (4 if self.norms == "sandwich" else 2) * h + (qk_norms if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense_layers = self.num_hidden_layers - len(self.moe_layers)
        return (self.num_hidden_layers * (attn + norms) + dense_layers * mlp + len(self.moe_layers) * moe + embed
                + h)

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
        if cfg.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"unsupported config field clip_qkv={cfg['clip_qkv']} (nanoserve does not "
                                        "clamp q, k and v)")
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
        max_len = cfg.get("max_position_embeddings", 2048)
        scaling = _rope_scaling({**legacy, **rope}, family, max_len, cfg.get("original_max_position_embeddings"))
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0 and not family.partial_rotary:
            raise UnsupportedModelError(f"unsupported config field partial_rotary_factor={partial} for {family.name}")
        pairs = int(head_dim * partial) // 2
        if scaling.rope_type == "longrope" and not len(scaling.short_factor) == len(scaling.long_factor) == pairs:
            raise UnsupportedModelError(f"longrope short_factor and long_factor must have {pairs} entries (one per "
                                        "rotary frequency)")
        shape = family.layer
        windows: tuple[int | None, ...] = ()
        local_theta = None
        if shape.interleaved_windows:
            windows = _layer_windows(cfg)
            if local_rope.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"unsupported rope type {local_rope['rope_type']!r} for local layers")
            local_theta = float(local_rope.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        # The family's multipliers from config.json; Gemma's scales set the same fields.
        multipliers: dict[str, Any] = {name: float(cfg.get(name, default)) for name, default in family.multipliers}
        if shape.embed_scale:
            multipliers["embedding_multiplier"] = hidden**0.5
        scalar = cfg.get("query_pre_attn_scalar")
        if scalar is not None:
            if "attention_multiplier" in multipliers:
                raise UnsupportedModelError(f"unsupported config field query_pre_attn_scalar for {family.name} "
                                            "(its attention scale is attention_multiplier)")
            multipliers["attention_multiplier"] = float(scalar) ** -0.5
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
            max_position_embeddings=max_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            qk_norm=family.qk_norm,
            rope_scaling=scaling,
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            native_decoder=family.native_decoder,
            partial_rotary_factor=partial,
            no_rope_layers=_no_rope_layers(cfg) if family.no_rope_layers else (),
            norms=shape.norms,
            qk_norm_over=shape.qk_norm_over,
            hidden_act=ACTIVATIONS[act],
            layer_windows=windows,
            local_rope_theta=local_theta,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
            **_moe_fields(cfg, family),
            **multipliers,
        )


def _moe_fields(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """The `ModelConfig` fields of a family with mixture-of-experts MLPs, as its `MoEShape` reads
    config.json (none for other families; a config that declares experts for a family without
    them is refused)."""
    moe = family.moe
    if moe is None:
        declared = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)]
        if declared:
            raise UnsupportedModelError(f"unsupported config field {declared[0]}={cfg[declared[0]]} for "
                                        f"{family.name} (its MLPs are dense)")
        return {}
    num_experts = next((int(cfg[k]) for k in moe.count_fields if cfg.get(k) is not None), 0)
    layers = cfg["num_hidden_layers"]
    if moe.sparse_step:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    else:
        for key in ("decoder_sparse_step", "mlp_only_layers"):
            if cfg.get(key) not in (None, 1, []):
                raise UnsupportedModelError(f"unsupported config field {key}={cfg[key]} for {family.name}")
        moe_layers = tuple(range(layers)) if num_experts > 0 else ()
    if not moe_layers:
        return {}
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise UnsupportedModelError(f"unsupported config field {key}={cfg[key]} (nanoserve implements no "
                                        "shared experts)")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg[moe.width_field]),
        "norm_topk_prob": True if moe.norm_switch is None else bool(cfg.get(moe.norm_switch, False)),
        "moe_weights_in_dtype": moe.weights_in_dtype,
        "moe_layers": moe_layers,
    }


def _no_rope_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """The layers without rotary by SmolLM3's config.json: `no_rope_layers` (a 0 or 1 per layer, 0
    for none), else every `no_rope_layer_interval`-th layer."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval") or 4
        return tuple(i for i in range(cfg["num_hidden_layers"]) if (i + 1) % interval == 0)
    if len(flags) != cfg["num_hidden_layers"]:
        raise UnsupportedModelError(f"no_rope_layers has {len(flags)} entries for {cfg['num_hidden_layers']} layers")
    return tuple(i for i, flag in enumerate(flags) if not flag)


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


def _rope_scaling(spec: dict[str, Any], family: Family, max_len: int, original: int | None) -> RopeScaling:
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type == "su":  # LongRoPE's earlier name
        rope_type = "longrope"
    if rope_type not in family.rope_types:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r}; nanoserve supports {list(family.rope_types)} "
            f"for {family.name}"
        )
    known = {f for f in RopeScaling.__slots__ if f not in ("rope_type", "short_factor", "long_factor")}
    fields = {k: v for k, v in spec.items() if k in known and v is not None}
    if rope_type != "longrope":
        fields.pop("attention_factor", None)
        return RopeScaling(rope_type=rope_type, **fields)
    fields.setdefault("original_max_position_embeddings", original or max_len)
    old_len = fields["original_max_position_embeddings"]
    if "attention_factor" not in fields:
        ratio = spec.get("factor") or max_len / old_len
        fields["attention_factor"] = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(old_len))
    return RopeScaling(rope_type=rope_type, short_factor=tuple(map(float, spec.get("short_factor") or ())),
                       long_factor=tuple(map(float, spec.get("long_factor") or ())), **fields)
