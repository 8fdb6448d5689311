"""What a model family is to nanoserve: a declaration, read by every part that depends on it.

Every family nanoserve runs is a decoder of RMSNorm blocks around grouped-query attention with
rotary embeddings and a gated MLP. Llama's layer (pre-norms, SwiGLU) is the default; a family whose
layers differ says how in its `LayerShape` (where the norms sit, (1 + w) norms, the gate's
activation, q/k norms per head or over the whole projection, scaled embeddings, interleaved local
and global layers). A `Family` states how its `config.json` maps onto the switches of
`ModelConfig`, the names its tensors have in Hugging Face checkpoints and in GGUF files and the
decoder parameter each one fills, how llama.cpp stores it, and whether the C++ decoder
runs it. `config.py`, `weights.py`, `gguf_reader.py` and `gguf_export.py` derive their tables from
these declarations; nothing else names a family.

Declarations only: this module imports nothing from the rest of nanoserve and holds no mutable
state. The Llama layout is declared here once, as the defaults; a family states what differs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

# Rotary scaling rules the decoder implements (`nanoserve.model.layers.rope_inv_freq`); "longrope"
# (Phi-3's LongRoPE, also spelt "su") only for families that list it in their `rope_types`.
ROPE_TYPES = ("default", "llama3", "linear", "longrope")

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


class TensorName(NamedTuple):
    """One checkpoint tensor under its Hugging Face and GGUF names, and where the decoder keeps it.

    Names of layer tensors are relative to the layer (`model.layers.{i}.` in Hugging Face files,
    `blk.{i}.` in GGUF files, `CausalLM.layers[i]` for `param`); others to the model. `param` is an
    attribute path on `CausalLM` (or on one of its layers); `rows`, when set, names the block of
    rows this tensor fills in a fused parameter: "q", "k" or "v" of `qkv_proj` / `qkv_bias`,
    "gate" or "up" of `gate_up_proj`; None on a fused parameter means the tensor fills all of it
    (a checkpoint that stores q/k/v or gate/up fused, as Phi-3's does).
    """

    hf: str
    gguf: str
    param: str
    rows: str | None = None
    # One expert's matrix of a mixture of experts: `hf` holds "{e}" where the expert's index goes
    # (Hugging Face files store each expert apart), and the tensor fills expert e's rows of `param`,
    # which stacks every expert's rows in expert order, as the GGUF tensor `gguf` stores them.
    experts: bool = False


class TensorRef(NamedTuple):
    """A `TensorName` of one layer (`layer` None for the embedding, final norm and LM head), and for
    an `experts` tensor the expert (None: the stack of all of them, as a GGUF file names it)."""

    layer: int | None
    tensor: TensorName
    expert: int | None = None

    @property
    def hf_name(self) -> str:
        """The Hugging Face name; an `experts` tensor's needs its expert."""
        if self.tensor.experts and self.expert is None:
            raise ValueError(f"{self.tensor.hf} names one expert's tensor: give the expert")
        name = self.tensor.hf.format(e=self.expert) if self.tensor.experts else self.tensor.hf
        return name if self.layer is None else f"model.layers.{self.layer}.{name}"

    @property
    def gguf_name(self) -> str:
        return self.tensor.gguf if self.layer is None else f"blk.{self.layer}.{self.tensor.gguf}"


GLOBAL_TENSORS = (
    TensorName("model.embed_tokens.weight", "token_embd.weight", "embed_tokens"),
    TensorName("model.norm.weight", "output_norm.weight", "norm.weight"),
    TensorName("lm_head.weight", "output.weight", "lm_head"),  # absent when tied to the embedding
)
LLAMA_LAYER_TENSORS = (
    TensorName("input_layernorm.weight", "attn_norm.weight", "input_layernorm.weight"),
    TensorName("self_attn.q_proj.weight", "attn_q.weight", "self_attn.qkv_proj", "q"),
    TensorName("self_attn.k_proj.weight", "attn_k.weight", "self_attn.qkv_proj", "k"),
    TensorName("self_attn.v_proj.weight", "attn_v.weight", "self_attn.qkv_proj", "v"),
    TensorName("self_attn.o_proj.weight", "attn_output.weight", "self_attn.o_proj"),
    TensorName("post_attention_layernorm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"),
    TensorName("mlp.gate_proj.weight", "ffn_gate.weight", "mlp.gate_up_proj", "gate"),
    TensorName("mlp.up_proj.weight", "ffn_up.weight", "mlp.gate_up_proj", "up"),
    TensorName("mlp.down_proj.weight", "ffn_down.weight", "mlp.down_proj"),
)
# RMSNorm weights of q and k (Qwen3, Gemma 3: per head; OLMo 2: over the whole projection).
QK_NORM_TENSORS = (
    TensorName("self_attn.q_norm.weight", "attn_q_norm.weight", "self_attn.q_norm.weight"),
    TensorName("self_attn.k_norm.weight", "attn_k_norm.weight", "self_attn.k_norm.weight"),
)


# A sparse mixture-of-experts MLP (Qwen3-MoE, OLMoE): the router and each expert's SwiGLU matrices,
# stacked by llama.cpp's converter into one GGUF tensor per kind (`ffn_*_exps`: [E, I, H]).
MOE_TENSORS = (
    TensorName("mlp.gate.weight", "ffn_gate_inp.weight", "mlp.router"),
    TensorName("mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight", "mlp.gate_exps", experts=True),
    TensorName("mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight", "mlp.up_exps", experts=True),
    TensorName("mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight", "mlp.down_exps", experts=True),
)
# The dense MLP's tensors, which an MoE layer has none of.
DENSE_MLP_PARAMS = ("mlp.gate_up_proj", "mlp.down_proj")


NORM_PLACEMENTS = ("pre", "sandwich", "post")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class LayerShape:
    """How a family's decoder layer differs from Llama's pre-norm SwiGLU block; the defaults are Llama's.

    - `norms`: "pre" normalizes each sublayer's input (Llama); "sandwich" its input and its output
      before the residual add (Gemma 2/3: four norms per layer); "post" its output only (OLMo 2).
    - `norm_offset`: checkpoints store w and the norm multiplies by (norm_offset + w) (Gemma: 1).
      The decoder keeps (norm_offset + w), as llama.cpp's GGUF files store it: the loader adds the
      offset to every norm weight of a Hugging Face checkpoint, GGUF files already hold the sum.
    - `qk_norm_over`: q/k RMSNorm (when the family has one) per head ("head", Qwen3, Gemma 3) or over
      the whole q and k projections ("projection", OLMo 2).
    - `embed_scale`: the embeddings are multiplied by sqrt(hidden_size) (it sets
      `ModelConfig.embedding_multiplier`, applied in the model's dtype).
    - `interleaved_windows`: config.json's `layer_types` (or `sliding_window_pattern`) makes some
      layers local, attending to their last `sliding_window` positions, with a rotary base of their
      own (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`); the others are global.
    """

    norms: str = "pre"
    norm_offset: float = 0.0
    qk_norm_over: str = "head"
    embed_scale: bool = False
    interleaved_windows: bool = False

    def __post_init__(self) -> None:
        if self.norms not in NORM_PLACEMENTS or self.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"unknown layer shape {self}")


@dataclass(frozen=True, slots=True)
class MoEShape:
    """How a family's config.json declares its sparse mixture-of-experts MLPs (no shared experts:
    none of the families declared so has them). The router is a [E, H] matrix; each token takes
    softmax over its E logits (fp32), keeps the top `num_experts_per_tok`, optionally
    renormalises those to sum to 1, and sums the chosen experts' SwiGLU outputs weighted so.

    - `count_fields`: config.json fields of the expert count E, the first present one read
      (transformers writes Qwen3-MoE's as `num_local_experts`, hub files as `num_experts`).
    - `width_field`: the field of each expert's intermediate width I.
    - `norm_switch`: the field saying whether the top-k weights are renormalised (absent: false);
      None: always renormalised (Mixtral, whose softmax is over the top-k logits, the same thing).
    - `weights_in_dtype`: the routing weights are rounded to the model's dtype before they weight
      the experts (transformers' Qwen3-MoE and OLMoE routers; Mixtral's keep fp32).
    - `sparse_step`: `decoder_sparse_step` and `mlp_only_layers` pick the MoE layers, the others
      being dense MLPs of `intermediate_size` (Qwen3-MoE); otherwise every layer is MoE.
    - `gguf_norm`: whether llama.cpp renormalises for the family's GGUF architecture, which it
      hard-codes (qwen3moe and llama: yes, olmoe: no); a file may say otherwise under
      `{arch}.expert_weights_norm`.
    - `gguf_width_key`: the GGUF key (after `{arch}.`) of the expert width.
    """

    count_fields: tuple[str, ...]
    width_field: str
    norm_switch: str | None
    weights_in_dtype: bool
    sparse_step: bool
    gguf_norm: bool
    gguf_width_key: str = "feed_forward_length"


@dataclass(frozen=True, slots=True)
class GGUFArch:
    """How llama.cpp stores a family: `general.architecture`, which also prefixes its
    hyperparameter keys (`{name}.block_count`, `{name}.attention.head_count`, ...)."""

    name: str
    # Q and K rows permuted from rotate-half to the interleaved rotary layout (the converter's
    # `LlamaModel.permute`); the reader undoes it, the exporter applies it.
    interleaved_rotary: bool = False
    # The converter also writes `{name}.vocab_size` and `{name}.rope.dimension_count` (the rotary
    # dimensions of a head, fewer than head_dim under partial rotary).
    vocab_and_rope_dims: bool = False
    # `{name}.attention.sliding_window` holds config.json's sliding_window (0: none).
    sliding_window: bool = False
    # (GGUF key after `{name}.`, config.json field) of the family's scalar multipliers.
    multipliers: tuple[tuple[str, str], ...] = ()
    # LongRoPE kept as `rope_factors_long.weight` / `rope_factors_short.weight` tensors with
    # `{name}.rope.scaling.original_context_length` and `.attn_factor` (llama.cpp's phi3).
    longrope_tensors: bool = False
    # llama.cpp's fixed rule for rotary-free layers: every layer i with (i + 1) % n == 0 (its
    # smollm3 reads no key for it); None: every layer has rotary.
    no_rope_interval: int | None = None


@dataclass(frozen=True, slots=True)
class Family:
    """One model family. `name` is `ModelConfig.family` and the `model_type` of its config.json
    (matched when no entry of `architectures` is one a family claims)."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures` entries of this family
    gguf: GGUFArch | None  # None: no GGUF files of this family are read or written
    qkv_bias: bool = False  # q, k and v projections always carry a bias (Qwen2)
    # A config.json flag that, when true, gives q, k, v and o a bias (transformers' Llama and Qwen3
    # read `attention_bias` so); the decoder has no o bias, so such a checkpoint is refused.
    bias_switch: str | None = None
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    # The config.json flag without which `sliding_window` is ignored (Qwen: `use_sliding_window`);
    # None: a `sliding_window` in config.json always applies (Mistral).
    sliding_window_switch: str | None = None
    rope_types: tuple[str, ...] = ROPE_TYPES  # rotary scaling rules accepted (a subset of ROPE_TYPES)
    # `partial_rotary_factor` (config.json or its rope parameters) is honoured: rotary on the first
    # head_dim * factor dimensions of each head (Phi-3, Phi-4-mini); elsewhere a factor != 1 is refused.
    partial_rotary: bool = False
    # config.json fields of scalar multipliers, with their defaults when absent (Granite's
    # embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling): each becomes
    # the `ModelConfig` field of that name.
    multipliers: tuple[tuple[str, float], ...] = ()
    # config.json's `no_rope_layers` (1: rotary, 0: none, per layer) or, without it, every
    # `no_rope_layer_interval`-th layer (default 4) without rotary (SmolLM3).
    no_rope_layers: bool = False
    layer_tensors: tuple[TensorName, ...] = LLAMA_LAYER_TENSORS
    global_tensors: tuple[TensorName, ...] = GLOBAL_TENSORS
    native_decoder: bool = True  # `nanoserve/csrc/decoder.cpp` implements these layers
    layer: LayerShape = LayerShape()  # how the layers differ from Llama's
    # config.json `hidden_act` / `hidden_activation` values accepted (keys of ACTIVATIONS).
    activations: tuple[str, ...] = ("silu",)
    # Prefixes of a multimodal checkpoint's text decoder, each with the `*ForCausalLM` prefix it
    # stands for (Gemma3ForConditionalGeneration: "model.language_model." for "model."); its
    # config.json then nests the decoder's fields in `text_config`. Other tensors are not read.
    text_prefixes: tuple[tuple[str, str], ...] = ()
    # Sparse mixture-of-experts MLPs (`nanoserve.model.moe`): how config.json declares them; their
    # tensors are among `layer_tensors` (`MOE_TENSORS`, or the family's names for them).
    moe: MoEShape | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rope_types) - set(ROPE_TYPES))
        if unknown:
            raise ValueError(f"family {self.name!r} accepts rope types the decoder lacks: {unknown}")
        unknown = sorted(set(self.activations) - set(ACTIVATIONS))
        if unknown:
            raise ValueError(f"family {self.name!r} accepts activations the decoder lacks: {unknown}")

    def causal_name(self, hf_name: str) -> str:
        """The name a `*ForCausalLM` checkpoint gives a tensor that a multimodal one stores under
        one of `text_prefixes`; any other name as it is."""
        for prefix, causal in self.text_prefixes:
            if hf_name.startswith(prefix):
                return causal + hf_name[len(prefix):]
        return hf_name

    def tensor_by_hf(self, hf_name: str) -> TensorRef | None:
        """The tensor a Hugging Face name denotes, or None if the family has no such tensor."""
        m = _HF_LAYER.match(hf_name)
        if m is None:
            return next((TensorRef(None, t) for t in self.global_tensors if t.hf == hf_name), None)
        layer, name = int(m.group(1)), m.group(2)
        for t in self.layer_tensors:
            if t.experts:
                expert = re.fullmatch(re.escape(t.hf).replace(r"\{e\}", r"(\d+)"), name)
                if expert is not None:
                    return TensorRef(layer, t, int(expert.group(1)))
            elif t.hf == name:
                return TensorRef(layer, t)
        return None

    def tensor_by_gguf(self, gguf_name: str) -> TensorRef | None:
        """The tensor a GGUF name denotes, or None if the family has no such tensor."""
        m = _GGUF_LAYER.match(gguf_name)
        if m is None:
            return next((TensorRef(None, t) for t in self.global_tensors if t.gguf == gguf_name), None)
        return next((TensorRef(int(m.group(1)), t) for t in self.layer_tensors if t.gguf == m.group(2)), None)


@dataclass(frozen=True, slots=True)
class FamilyRegistry:
    """The families nanoserve knows, in order. A value: `extended` returns a new registry, and
    every reader takes one (defaulting to `nanoserve.model.families.FAMILIES`).

    Invariants: names and architecture names are unique. Several families may share a GGUF
    architecture (llama.cpp writes Mistral as `llama`); a file of that architecture reads as the
    first of them.
    """

    families: tuple[Family, ...]

    def __post_init__(self) -> None:
        for what, values in (("name", [f.name for f in self.families]),
                             ("architecture", [a for f in self.families for a in f.architectures])):
            duplicates = sorted({v for v in values if values.count(v) > 1})
            if duplicates:
                raise ValueError(f"more than one family has the {what} {duplicates[0]!r}")

    def extended(self, *families: Family) -> FamilyRegistry:
        """This registry with `families` added after its own."""
        return FamilyRegistry((*self.families, *families))

    def __getitem__(self, name: str) -> Family:
        family = next((f for f in self.families if f.name == name), None)
        if family is None:
            raise KeyError(f"no model family {name!r}; known: {[f.name for f in self.families]}")
        return family

    @property
    def architectures(self) -> list[str]:
        """Every config.json architecture name, sorted."""
        return sorted(a for f in self.families for a in f.architectures)

    @property
    def gguf_architectures(self) -> list[str]:
        """Every GGUF architecture name, sorted."""
        return sorted({f.gguf.name for f in self.families if f.gguf is not None})

    def for_hf_config(self, cfg: dict[str, Any]) -> Family | None:
        """The family of a parsed config.json: by its first architecture any family claims, else by
        its model_type; None if neither is known."""
        for arch in cfg.get("architectures") or []:
            family = next((f for f in self.families if arch in f.architectures), None)
            if family is not None:
                return family
        return next((f for f in self.families if f.name == cfg.get("model_type")), None)

    def for_gguf_arch(self, arch: str, experts: bool = False) -> Family | None:
        """The first family stored as GGUF architecture `arch` whose MLPs are mixtures of experts
        when `experts` (the file's `{arch}.expert_count` > 0: llama.cpp writes Mixtral as `llama`)
        and dense otherwise, or None."""
        return next((f for f in self.families if f.gguf is not None and f.gguf.name == arch
                     and (f.moe is not None) == experts), None)
