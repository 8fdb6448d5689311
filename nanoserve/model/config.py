"""Model configuration: one frozen description of a decoder, read from a Hugging Face `config.json`.

The supported families (Llama 2/3/3.1/3.2, Qwen2/2.5, Qwen3, Mistral) share one decoder shape and
differ only in a few switches recorded here: bias on q/k/v, RMSNorm on q and k, tied embeddings and
the rotary scaling rule. Anything outside that set fails at load with a message that names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """A checkpoint asks for an architecture or a setting this decoder does not implement."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary scaling rule. `rope_type` is one of ROPE_TYPES; the other fields matter per type."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and switches of one decoder-only transformer.

    Invariants: `num_attention_heads % num_key_value_heads == 0`; `head_dim` is explicit (it need
    not equal hidden_size / num_attention_heads, as in Qwen3).
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
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + mlp + norms) + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Builds a config from a parsed `config.json`; raises UnsupportedModelError on anything
        this decoder would compute differently from the reference."""
        archs = cfg.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            model_type = cfg.get("model_type")
            family = model_type if model_type in ARCHITECTURES.values() else None
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"nanoserve supports {sorted(ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("unsupported config field mlp_bias=true")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rope = cfg.get("rope_parameters") or {}
        legacy = cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = _rope_scaling({**legacy, **rope})
        window = cfg.get("sliding_window")
        if family == "qwen2" or family == "qwen3":
            window = window if cfg.get("use_sliding_window") else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            family=family,
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
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=scaling,
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
        )


def _rope_scaling(spec: dict[str, Any]) -> RopeScaling:
    rope_type = spec.get("rope_type") or spec.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r}; nanoserve supports {list(ROPE_TYPES)}"
        )
    known = {f for f in RopeScaling.__slots__ if f != "rope_type"}
    return RopeScaling(rope_type=rope_type, **{k: v for k, v in spec.items() if k in known})
