"""Reads a GGUF file (llama.cpp's format) into what `load_model` needs: a `config.json`-style dict, a
tokenizer, and tensors under Hugging Face names in Hugging Face layout.

Invariants:
- Nothing is unpickled. Tensors are read from a copy-on-write memory map and converted one at a
  time, so the file is never modified and never held twice in memory: nothing writes to the map,
  and once `weights()` resumes after a tensor (its consumer has copied it) that tensor's pages are
  dropped from the map (`MADV_DONTNEED`), as are the metadata's once parsed. Dropping a page of a
  private mapping that was never written only releases it: a later read (a page shared with the
  next tensor, a view still held) reads the file again. So a load's resident memory peaks near
  the copies' size plus one tensor, not the copies plus the whole file.
- The file's architecture selects a family of the registry (`nanoserve.model.families`); its
  declaration names the tensors and says how llama.cpp stores them.
- `weights()` yields exactly what the safetensors checkpoint the file was converted from holds
  (up to the file's precision): shapes in torch order (GGUF lists dims in reverse), norm weights
  of families with a `LayerShape.norm_offset` less that offset (llama.cpp stores 1 + w), and the Q/K
  rows of files whose architecture stores them interleaved (`llama`) un-permuted from llama.cpp's
  interleaved rotary layout back to the rotate-half layout of `transformers`.
- A mixture of experts' stacked expert tensors (`ffn_gate_exps` etc., [E, I, H]) come as one
  tensor per expert under its Hugging Face name (rows e * I .. (e + 1) * I: views of the map,
  blocks untouched), which the loader writes back into the model's stacked matrix.
- Tensors of a type nanoserve multiplies in its block format (`KEPT_TYPES`: Q8_0, Q4_0, Q4_1,
  Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q2_K) come as `QuantizedRows`, the file's
  bytes untouched (a row permutation moves whole rows of blocks: blocks run along a row);
  `tensor_formats` names them before any is read. Every other type is converted to the dtype
  asked for.
- The rebuilt tokenizer tokenizes as llama.cpp does: byte-level BPE split by the file's
  `tokenizer.ggml.pre` as llama.cpp splits for that name (`nanoserve.tokenizer.pre_tokenizers`; an
  unknown pre-tokenizer fails rather than silently splitting text differently), SentencePiece
  BPE by piece scores, or Gemma 4's BPE over SentencePiece-style pieces by its merges
  (`nanoserve.tokenizer.sentencepiece_bpe`).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import gguf
import numpy as np
import numpy.typing as npt
import tokenizers
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor, TokenType
from tokenizers import AddedToken, decoders

from nanoserve.model.checkpoint import gguf_header
from nanoserve.model.config import ModelLoadError, RopeScaling, UnsupportedModelError
from nanoserve.model.families import FAMILIES, Family, FamilyRegistry, GGUFArch, TensorRef
from nanoserve.model.layers import rope_inv_freq
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, QuantizedRows
from nanoserve.tokenizer import sentencepiece_bpe
from nanoserve.tokenizer.pre_tokenizers import NOT_BYTE_LEVEL, PRE_TOKENIZERS, PreTokenizer
from nanoserve.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's per-frequency divisors past and within the original context (llama.cpp's phi3).
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
# Metadata key (ours, ignored by llama.cpp) holding the exact HF llama3 rope parameters as JSON;
# llama.cpp files carry only the per-frequency factors in ROPE_FREQS.
ROPE_SCALING_KEY = "nanoserve.rope_scaling"

# Control tokens llama.cpp treats as end of generation besides the eos/eot/eom ids in the metadata.
_END_OF_GENERATION_TEXTS = frozenset(
    {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
     "<|end_of_text|>", "<EOT>"}
)
# GGUF tensor types kept in their block format, and the format of each.
KEPT_TYPES: Mapping[QType, str] = MappingProxyType({f.qtype: name for name, f in BLOCK_FORMATS.items()})


class GGUFCheckpoint(NamedTuple):
    """A GGUF file opened for loading. `tensors` stay memory-mapped until `weights()` reads them;
    `family` is the one the file's architecture selected (its `gguf` is set)."""

    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    generation_eos: tuple[int, ...]
    tensors: tuple[ReaderTensor, ...]
    family: Family
    mapping: mmap.mmap  # the file's copy-on-write map that `tensors` view

    @property
    def num_experts(self) -> int:
        """E of a mixture of experts' layers (0 for a dense model)."""
        moe = self.family.moe
        return 0 if moe is None else int(self.hf_config[moe.count_fields[0]])

    @property
    def tensor_formats(self) -> dict[str, str]:
        """HF name -> block format of every tensor `weights()` yields as `QuantizedRows`."""
        refs = ((self.family.tensor_by_gguf(t.name), t.tensor_type) for t in self.tensors)
        experts = range(self.num_experts)
        return {r.hf_name: KEPT_TYPES[kind] for ref, kind in refs if ref is not None and kind in KEPT_TYPES
                for r in ([ref._replace(expert=e) for e in experts] if ref.tensor.experts else [ref])}

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
        """(HF name, tensor in HF layout) pairs, read when reached: `QuantizedRows` sharing the
        file's memory map (one copy for un-permuted rows) for `KEPT_TYPES`, others converted to
        `dtype`. A destination that keeps no blocks dequantizes them (`load_weights`). Each
        tensor's pages are dropped from the map once the consumer asks for the next one."""
        cfg = self.hf_config
        heads = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}
        interleaved = self.family.gguf is not None and self.family.gguf.interleaved_rotary
        for t in self.tensors:
            if t.name in (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT):  # in hf_config's rope parameters
                continue
            ref = self.family.tensor_by_gguf(t.name)
            if ref is None:
                log.warning("ignoring GGUF tensor %s (not used by this model)", t.name)
                continue
            offset = self.family.layer.norm_offset if ref.tensor.param.endswith("norm.weight") else 0.0
            if t.tensor_type in KEPT_TYPES:
                x: torch.Tensor | QuantizedRows = _quantized_rows(t)
            elif offset:  # the file stores (offset + w); the checkpoint it came from, w
                x = (_to_torch(t, torch.float32) - offset).to(dtype)
            else:
                x = _to_torch(t, dtype)
            rows = ref.tensor.rows
            if interleaved and rows is not None and rows in heads:
                x = x[unpermute_rotary(torch.arange(x.shape[0]), heads[rows])]
            if ref.tensor.experts:
                yield from _per_expert(ref, x, self.num_experts, t.name)
            else:
                yield ref.hf_name, x
            _release(self.mapping, t.data_offset, t.data_offset + t.n_bytes)


def _per_expert(ref: TensorRef, x: torch.Tensor | QuantizedRows, num_experts: int,
                name: str) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Each expert's rows of a stacked expert tensor (x: [E, rows, in] dense or [E * rows] block
    rows) under its Hugging Face name, as views."""
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1, x.shape[-1])
    if x.shape[0] % num_experts:
        raise UnsupportedModelError(f"GGUF tensor {name} has {x.shape[0]} rows, not a multiple of the "
                                    f"{num_experts} experts")
    rows = x.shape[0] // num_experts
    for e in range(num_experts):
        yield ref._replace(expert=e).hf_name, x[e * rows:(e + 1) * rows]


class _Reader(GGUFReader):
    """`GGUFReader` that parses through a plain ndarray view of its memory map instead of the
    `np.memmap` itself: the same bytes, without numpy's Python-level memmap bookkeeping on every
    slice, which dominates reading a large vocabulary and its merges otherwise.
    Overrides the reader's private `_get` with the same signature and result, and checks before
    the private `_build_tensors` views any tensor that every tensor lies inside the file."""

    def __init__(self, path: str | Path, mode: Literal["r", "r+", "c"] = "r") -> None:
        self._name = Path(path).name
        super().__init__(path, mode)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, kind, offset = field.parts
            block, type_size = gguf.GGML_QUANT_SIZES[QType(int(kind[0]))]
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ModelLoadError(f"{self._name}: truncated: tensor {bytes(name).decode()} ends past the file "
                                     f"(at byte {end} of {size})")
        super()._build_tensors(start_offs, fields)

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        flat = self.__dict__.get("_flat")
        if flat is None:
            flat = self._flat = self.data.view(np.ndarray)
        count = int(count)
        if offset + np.dtype(dtype).itemsize * count > len(flat):
            raise ModelLoadError(f"{self._name}: truncated: the metadata ends past the file")
        arr = flat[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def read_gguf(path: str | Path, families: FamilyRegistry = FAMILIES) -> GGUFCheckpoint:
    """Opens `path` and reads its metadata and tokenizer; tensors are read later by `weights()`.

    Raises UnsupportedModelError naming the architecture (none of `families` is stored as it;
    found from the file's head before the rest is parsed), tokenizer or setting that nanoserve
    does not implement, and ModelLoadError for a file that is not GGUF or is cut short.
    """
    arch = gguf_header.architecture(path)
    if arch is None or arch not in families.gguf_architectures:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} in {Path(path).name}; "
            f"nanoserve reads {families.gguf_architectures}"
        )
    reader = _open(path)
    meta = _metadata(reader)
    experts = bool(meta.get(f"{arch}.expert_count"))
    family = families.for_gguf_arch(arch, experts)
    if family is None:
        what = "mixture-of-experts" if experts else "dense (expert_count 0)"
        raise UnsupportedModelError(f"unsupported GGUF model: {what} {arch!r} in {Path(path).name}; nanoserve "
                                    f"reads {arch!r} files {'without' if experts else 'with'} experts only")
    generation_eos = _generation_eos(meta)
    tokenizer = _tokenizer(meta, generation_eos)
    hf_config = _hf_config(meta, family, {t.name: t for t in reader.tensors})
    other = sorted({t.tensor_type.name for t in reader.tensors
                    if len(t.shape) > 1 and t.tensor_type not in (*KEPT_TYPES, QType.F32)})
    if other:
        log.info("%s: converting %s tensors to the model's dtype at load (nanoserve multiplies %s blocks)",
                 Path(path).name, ", ".join(other), ", ".join(q.name for q in KEPT_TYPES))
    mapping = reader.data._mmap  # type: ignore[attr-defined]  # np.memmap's own map of the file
    assert isinstance(mapping, mmap.mmap)
    if reader.tensors:  # metadata and tokenizer are parsed into Python values by now
        _release(mapping, 0, min(t.data_offset for t in reader.tensors))
    return GGUFCheckpoint(hf_config, tokenizer, generation_eos, tuple(reader.tensors), family, mapping)


def read_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file alone, whatever its architecture (a vocabulary-only file, such as
    llama.cpp's test vocabularies), as `read_gguf` builds it."""
    meta = read_gguf_metadata(path)
    return _tokenizer(meta, _generation_eos(meta))


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key/value pair of a GGUF file as Python values (as `read_gguf` reads them)."""
    return _metadata(_open(path))


def _open(path: str | Path) -> _Reader:
    """The file's reader, its metadata parsed; a file it cannot lay out is a ModelLoadError."""
    try:
        return _Reader(path, mode="c")
    except (ValueError, KeyError) as e:  # the gguf package's own checks of the layout
        raise ModelLoadError(f"{Path(path).name}: not a valid GGUF file ({e})") from None


def _release(mapping: mmap.mmap, start: int, end: int) -> None:
    """Drops the pages of `mapping` (private, never written) that hold bytes [start, end): from the
    page holding `start` up to the one holding `end - 1`, so a page shared with a neighbouring
    range is dropped too and read from the file again if that range is read."""
    if end > start:
        first = start - start % mmap.PAGESIZE
        mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a Q or K projection from rotate-half to llama.cpp's interleaved rotary layout
    (llama.cpp's `LlamaModel.permute`): within each head, row i of the first half and row i of the
    second half become rows 2i and 2i+1."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `permute_rotary`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for a rope scaling rule: the divisor of each rotary frequency."""
    return rope_inv_freq(head_dim, theta, RopeScaling()) / rope_inv_freq(head_dim, theta, scaling)


def fit_llama3_scaling(factors: torch.Tensor, head_dim: int, theta: float) -> dict[str, Any]:
    """HF llama3 rope parameters that reproduce llama.cpp's per-frequency `factors`.

    The factors fix only the scale factor and the two wavelength thresholds (original context /
    low_freq_factor, original context / high_freq_factor). We take low_freq_factor = 1, Llama 3.x's
    value, which makes the original context the low threshold. Needs at least two frequencies
    between the thresholds (true of real Llama 3.x head sizes).
    """
    f = factors.double()
    factor = f.max().item()
    wavelen = 2 * math.pi / rope_inv_freq(head_dim, theta, RopeScaling()).double()
    mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if int(mid.sum()) < 2:
        raise UnsupportedModelError(
            "cannot recover llama3 rope scaling from rope_freqs.weight: "
            "fewer than two interpolated frequencies"
        )
    # smooth = old / (wavelen * (high - low)) - low / (high - low): linear in 1 / wavelen.
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    design = torch.stack([1 / wavelen[mid], torch.ones_like(smooth)], dim=1)
    slope, intercept = torch.linalg.lstsq(design, smooth[:, None]).solution.flatten().tolist()
    return {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{1 - 1 / intercept:.6g}"),
        "original_max_position_embeddings": round(-slope / intercept),
    }


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value fields as Python values. float32 scalars become the shortest decimal that
    rounds to them (1e-06, not 9.99999997e-07), i.e. the value the converter was given."""
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        meta[name] = value
    return meta


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModelError(f"GGUF metadata lacks {key!r}")
    return meta[key]


def _hf_config(meta: dict[str, Any], family: Family, tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """The `config.json` the file was converted from, as far as the decoder needs it."""
    assert family.gguf is not None
    arch = family.gguf.name
    heads = _require(meta, f"{arch}.attention.head_count")
    hidden = _require(meta, f"{arch}.embedding_length")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    theta = meta.get(f"{arch}.rope.freq_base", 10000.0)
    layers = _require(meta, f"{arch}.block_count")
    rotary_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    return {
        **_layer_shape_config(meta, family, heads, hidden, head_dim),
        "architectures": [family.architectures[0]],
        "model_type": family.name,
        "vocab_size": len(_require(meta, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": _require(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": family.activations[0],
        "rms_norm_eps": _require(meta, f"{arch}.attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": _require(meta, f"{arch}.context_length"),
        "rope_parameters": {"rope_theta": theta, **_rope_scaling(meta, arch, tensors, head_dim, theta),
                            **({} if rotary_dim == head_dim else {"partial_rotary_factor": rotary_dim / head_dim})},
        **_family_fields(meta, family.gguf, layers),
        **_moe_config(meta, family),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def _family_fields(meta: dict[str, Any], arch: GGUFArch, layers: int) -> dict[str, Any]:
    """The config.json fields of what only some architectures store: a sliding window, multipliers,
    the layers without rotary."""
    fields: dict[str, Any] = {}
    if arch.sliding_window and meta.get(f"{arch.name}.attention.sliding_window"):
        fields["sliding_window"] = meta[f"{arch.name}.attention.sliding_window"]
    for key, field in arch.multipliers:
        if f"{arch.name}.{key}" in meta:
            fields[field] = meta[f"{arch.name}.{key}"]
    if arch.no_rope_interval is not None:
        fields["no_rope_layers"] = [int((i + 1) % arch.no_rope_interval != 0) for i in range(layers)]
    return fields


def _moe_config(meta: dict[str, Any], family: Family) -> dict[str, Any]:
    """The config.json fields of a mixture of experts as llama.cpp reads the file: expert count,
    experts per token, the expert width (under the family's `gguf_width_key`), and whether the
    top-k weights are renormalised (`expert_weights_norm`, else llama.cpp's fixed rule for the
    architecture). A softmax router only, weights unscaled, no shared experts: anything else is
    refused."""
    moe, arch = family.moe, family.gguf.name if family.gguf is not None else family.name
    if moe is None:
        return {}
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating is not None and gating != gguf.ExpertGatingFuncType.SOFTMAX:
        raise UnsupportedModelError(f"unsupported GGUF {arch}.expert_gating_func={gating} (nanoserve routes by "
                                    "softmax)")
    if meta.get(f"{arch}.expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise UnsupportedModelError(f"unsupported GGUF {arch}.expert_weights_scale="
                                    f"{meta[f'{arch}.expert_weights_scale']}")
    if meta.get(f"{arch}.expert_shared_count"):
        raise UnsupportedModelError(f"unsupported GGUF {arch}.expert_shared_count (nanoserve implements no shared "
                                    "experts)")
    norm = bool(meta.get(f"{arch}.expert_weights_norm", moe.gguf_norm))
    if moe.norm_switch is None and not norm:
        raise UnsupportedModelError(f"unsupported GGUF {arch}.expert_weights_norm=false for {family.name}")
    return {
        moe.count_fields[0]: _require(meta, f"{arch}.expert_count"),
        "num_experts_per_tok": _require(meta, f"{arch}.expert_used_count"),
        moe.width_field: _require(meta, f"{arch}.{moe.gguf_width_key}"),
        **({} if moe.norm_switch is None else {moe.norm_switch: norm}),
    }


def _decimals(t: ReaderTensor) -> list[float]:
    """An F32 vector as the shortest decimals that round to its values (as `_metadata` reads float32
    scalars): the numbers the converter was given."""
    return [float(str(v)) for v in _to_torch(t, torch.float32).numpy()]
# llama.cpp's Gemma 3 defaults for what its files do not carry: the local layers' rotary base, and
# every LOCAL_PATTERN-th layer global.
LOCAL_ROPE_BASE = 10000.0
LOCAL_PATTERN = 6


def _layer_shape_config(meta: dict[str, Any], family: Family, heads: int, hidden: int,
                        head_dim: int) -> dict[str, Any]:
    """The config.json fields of a family whose layers differ from Llama's, as llama.cpp reads them:
    the sliding window, which layers are local (`attention.sliding_window_pattern`: a period or
    one flag per layer, true for local; absent: every sixth layer global), the local rotary base
    (`rope.freq_base_swa`, else 10000), the attention scale (`attention.scale`, else 1/sqrt of
    the head size, or of hidden/heads for Gemma 3 27B's 62 layers, as llama.cpp sets it) and the
    final logit softcap."""
    arch = family.gguf.name if family.gguf is not None else family.name
    out: dict[str, Any] = {}
    softcap = meta.get(f"{arch}.final_logit_softcapping")
    if softcap:
        out["final_logit_softcapping"] = softcap
    if not family.layer.interleaved_windows:
        return out
    layers = _require(meta, f"{arch}.block_count")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", LOCAL_PATTERN)
    local = ([bool(x) for x in pattern] if isinstance(pattern, list)
             else [(i + 1) % int(pattern) != 0 for i in range(layers)])
    scale = meta.get(f"{arch}.attention.scale")
    default_scalar = hidden // heads if layers == 62 else head_dim
    scalar = float(f"{float(scale) ** -2:.6g}") if scale else default_scalar
    out.update({
        "sliding_window": _require(meta, f"{arch}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        "rope_local_base_freq": meta.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE),
        "query_pre_attn_scalar": scalar,
    })
    return out


def _rope_scaling(
    meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], head_dim: int, theta: float
) -> dict[str, Any]:
    """Rope scaling as HF `rope_parameters` entries. llama.cpp keeps linear scaling in metadata
    (type defaults to linear, as llama.cpp reads it), llama3 scaling as ROPE_FREQS factors and
    LongRoPE as ROPE_FACTORS_LONG / _SHORT with the original context and attention factor."""
    if ROPE_FACTORS_LONG in tensors and ROPE_FACTORS_SHORT in tensors:
        spec = {"rope_type": "longrope",
                "long_factor": _decimals(tensors[ROPE_FACTORS_LONG]),
                "short_factor": _decimals(tensors[ROPE_FACTORS_SHORT]),
                "original_max_position_embeddings": _require(meta, f"{arch}.rope.scaling.original_context_length")}
        if f"{arch}.rope.scaling.attn_factor" in meta:
            spec["attention_factor"] = meta[f"{arch}.rope.scaling.attn_factor"]
        return spec
    kind = meta.get(f"{arch}.rope.scaling.type", "linear")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 1.0
    freqs = tensors.get(ROPE_FREQS)
    if kind not in ("none", "linear") and factor != 1.0:
        raise UnsupportedModelError(
            f"unsupported GGUF rope scaling type {kind!r}; nanoserve reads linear and llama3"
        )
    if freqs is None:
        linear = kind == "linear" and factor != 1.0
        return {"rope_type": "linear", "factor": factor} if linear else {"rope_type": "default"}
    if factor != 1.0:
        raise UnsupportedModelError("unsupported GGUF rope scaling: rope_freqs.weight and a scaling factor")
    factors = _to_torch(freqs, torch.float32)
    if ROPE_SCALING_KEY in meta:
        spec = json.loads(meta[ROPE_SCALING_KEY])
    else:
        spec = fit_llama3_scaling(factors, head_dim, theta)
    known = {k: v for k, v in spec.items() if k in RopeScaling.__slots__}
    expected = llama3_rope_factors(head_dim, theta, RopeScaling(**known))
    if not torch.allclose(expected, factors, rtol=1e-4, atol=0.0):
        raise UnsupportedModelError("unsupported GGUF rope scaling: rope_freqs.weight is not the llama3 rule")
    return spec


def _to_torch(t: ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor in torch order and `dtype`. `t.data` is already in torch (row-major) order: the
    reader reverses GGUF's dims; quantized data comes as raw bytes per row."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if t.tensor_type in (QType.F32, QType.F16):
        x = torch.from_numpy(t.data)
    elif t.tensor_type == QType.BF16:
        x = torch.from_numpy(t.data.view(np.int16)).view(torch.bfloat16)
    else:
        try:
            x = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        except NotImplementedError:
            raise UnsupportedModelError(f"GGUF tensor {t.name} has type {t.tensor_type.name}, "
                                        f"which the gguf package cannot dequantize") from None
    return x.reshape(shape).to(dtype)


def _quantized_rows(t: ReaderTensor) -> QuantizedRows:
    """A 2-D tensor of a `KEPT_TYPES` type as its raw blocks: uint8 [rows, row_bytes], a view of the
    memory map (the reader lays a quantized tensor out so already)."""
    if t.data.ndim not in (2, 3):
        raise UnsupportedModelError(f"GGUF tensor {t.name} of type {t.tensor_type.name} is not a matrix or a stack "
                                    "of them")
    data = torch.from_numpy(t.data.view(np.ndarray))
    return QuantizedRows(KEPT_TYPES[t.tensor_type], data.reshape(-1, data.shape[-1]), int(t.shape[0]))


def _generation_eos(meta: dict[str, Any]) -> tuple[int, ...]:
    """eos, eot and eom ids from the metadata, then control tokens llama.cpp also ends generation on."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens", [])
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    ids += [i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
            if kind == TokenType.CONTROL and tok in _END_OF_GENERATION_TEXTS]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def _tokenizer(meta: dict[str, Any], stop_ids: tuple[int, ...]) -> Tokenizer:
    """Rebuilds the file's tokenizer: byte-level BPE (`tokenizer.ggml.model` "gpt2") from tokens,
    token types and merges, SentencePiece BPE ("llama": Llama 2, Mistral) from tokens, scores
    and token types, or Gemma 4's BPE over SentencePiece-style pieces ("gemma4") from tokens,
    token types and merges.

    Control tokens (type 3) become special added tokens, user-defined ones (type 4) non-special
    added tokens, as in the tokenizer.json they came from; unused (type 5) padding entries stay out
    of the vocabulary. Byte-level BPE gets no normalizer: llama.cpp applies none (a Qwen2
    tokenizer.json has NFC, so non-NFC input can tokenize differently from it, as it does in
    llama.cpp).
    """
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    bos, eos = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    if model == "gpt2":
        backend, pre = _byte_level_bpe(meta, tokens, types)
        add_bos = pre.add_bos
        bos = bos if pre.has_bos else None
    elif model == "llama":
        backend = sentencepiece_bpe.build(tokens, _require(meta, "tokenizer.ggml.scores"), types,
                                          meta.get("tokenizer.ggml.unknown_token_id"),
                                          bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos = True  # llama.cpp's default for SentencePiece vocabularies
    elif model == "gemma4":
        backend = sentencepiece_bpe.build_from_merges(tokens, _require(meta, "tokenizer.ggml.merges"), types)
        add_bos = True
    else:
        raise UnsupportedModelError(
            f"unsupported GGUF tokenizer model {model!r}; nanoserve reads byte-level BPE ('gpt2'), "
            "SentencePiece BPE ('llama') and Gemma 4's BPE ('gemma4')"
        )
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, kind in enumerate(types) if kind == TokenType.CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED])
    return Tokenizer(
        backend,
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        chat_template=meta.get("tokenizer.chat_template"),
        # llama.cpp overrides a Gemma 4 file's add_bos_token false (its PR 21500)
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) or model == "gemma4",
        extra_stop_token_ids=stop_ids,
        tool_chat_template=meta.get("tokenizer.chat_template.tool_use"),
    )


def _byte_level_bpe(
    meta: dict[str, Any], tokens: list[str], types: list[int]
) -> tuple[tokenizers.Tokenizer, PreTokenizer]:
    """The byte-level BPE model of a "gpt2" vocabulary, split as llama.cpp splits for the file's
    `tokenizer.ggml.pre` (`nanoserve.tokenizer.pre_tokenizers`; none given is llama.cpp's
    "default", with its warning), and that pre-tokenizer's rule (its BOS defaults)."""
    pre_name = meta.get("tokenizer.ggml.pre")
    if pre_name is None:
        log.warning("GGUF vocabulary names no pre-tokenizer: splitting with llama.cpp's 'default' rules, "
                    "which may not be the ones the model was trained with")
        pre_name = "default"
    if pre_name not in PRE_TOKENIZERS:
        kind = "a vocabulary that is not byte-level BPE" if pre_name in NOT_BYTE_LEVEL else "unknown"
        raise UnsupportedModelError(
            f"unsupported GGUF pre-tokenizer {pre_name!r} ({kind}); nanoserve reads the {len(PRE_TOKENIZERS)} "
            "names llama.cpp reads for byte-level BPE (nanoserve.tokenizer.pre_tokenizers)"
        )
    pre = PRE_TOKENIZERS[pre_name]
    if "tokenizer.ggml.merges" not in meta:  # llama.cpp reads kimi-k2 without them, by its own code
        raise UnsupportedModelError(f"GGUF byte-level BPE vocabulary (pre-tokenizer {pre_name!r}) without "
                                    "tokenizer.ggml.merges: nanoserve merges by the stored merges only")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)) if kind != TokenType.UNUSED}
    backend = tokenizers.Tokenizer(pre.model(vocab, merges))
    backend.pre_tokenizer = pre.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend, pre
