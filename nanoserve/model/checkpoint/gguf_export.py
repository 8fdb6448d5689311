"""Writes a GGUF file from a Hugging Face folder, as llama.cpp's `convert_hf_to_gguf.py` would.

Same metadata keys, tensor names and tensor types as the converter (names and GGUF architecture from
the model's family, `nanoserve.model.families`): Q and K rows of architectures that store them
interleaved (`llama`: Llama, Mistral) permuted to that rotary layout, 1-D tensors and norms kept F32
(with the family's `LayerShape.norm_offset` added, as the converter writes Gemma's 1 + w), tied
embeddings written once (no `output.weight`), llama3 rope scaling as `rope_freqs.weight` factors,
LongRoPE as `rope_factors_long/short.weight` with its original context and attention factor
(phi3), a family's multipliers and sliding window under the keys its `GGUFArch` names, local layers
as the sliding window, its rotary base and one flag per layer (true: local), the tokenizer as
byte-level BPE ("gpt2") with tokens, token types, merges, its pre-tokenizer name, special ids and
chat template (through `gguf.SpecialVocab`, as the converter does). A mixture of experts as the
converter writes it: `{arch}.expert_count`, `.expert_used_count` (and qwen3moe's
`.expert_feed_forward_length`), each layer's experts stacked into one tensor per kind
(`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`: [E, I, H] and [E, H, I]) in the output type, the
router (`ffn_gate_inp`) F32. One addition llama.cpp ignores:
ROPE_SCALING_KEY keeps the exact llama3 rope parameters, which the factors alone do not determine;
and where a checkpoint's `norm_topk_prob` is not what llama.cpp fixes for its architecture, the file
says so in `{arch}.expert_weights_norm` (which nanoserve reads and llama.cpp does not, with a warning).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import tokenizers
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType, TokenType

from nanoserve.model.checkpoint.gguf_reader import (
    LOCAL_PATTERN,
    LOCAL_ROPE_BASE,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS,
    ROPE_SCALING_KEY,
    llama3_rope_factors,
    permute_rotary,
)
from nanoserve.model.checkpoint.loader import iter_safetensors, safetensors_files
from nanoserve.model.checkpoint.weights import per_expert
from nanoserve.model.config import ModelConfig
from nanoserve.model.families import FAMILIES, Family, FamilyRegistry, GGUFArch
from nanoserve.tokenizer.pre_tokenizers import GPT2_REGEX, PRE_TOKENIZERS, canonical_name, run_as

log = logging.getLogger(__name__)

OUT_TYPES = {
    "F32": (QType.F32, LlamaFileType.ALL_F32),
    "F16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (QType.BF16, LlamaFileType.MOSTLY_BF16),
    "Q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (QType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}


def export_gguf(
    hf_dir: str | Path, out_path: str | Path, out_type: str = "F32", families: FamilyRegistry = FAMILIES
) -> Path:
    """Converts the checkpoint in `hf_dir` (config.json, *.safetensors, tokenizer.json,
    tokenizer_config.json) of a model of one of `families` to a GGUF file at `out_path` with
    matrices stored as `out_type` (F32, F16, BF16, Q8_0 or Q4_0); returns `out_path`. Raises ValueError
    for what it cannot convert."""
    if out_type not in OUT_TYPES:
        raise ValueError(f"unknown GGUF output type {out_type!r}; choose one of {sorted(OUT_TYPES)}")
    folder, out = Path(hf_dir), Path(out_path)
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_hf_dict(hf_config, families)
    family = families[cfg.family]
    arch = family.gguf
    if arch is None:
        raise ValueError(f"{folder.name}: the {family.name} family has no GGUF architecture")
    qtype, ftype = OUT_TYPES[out_type]
    if arch.no_rope_interval is not None and cfg.no_rope_layers != _every(arch.no_rope_interval, cfg):
        raise ValueError(f"{folder.name}: layers {list(cfg.no_rope_layers)} without rotary; llama.cpp's {arch.name} "
                         f"takes every {arch.no_rope_interval}th layer")
    if cfg.sliding_window is not None and not arch.sliding_window:
        log.warning("%s: sliding_window=%d is not written; llama.cpp's %s architecture has no sliding window",
                    folder.name, cfg.sliding_window, arch.name)
    if cfg.rope_scaling.rope_type == "longrope" and not arch.longrope_tensors:
        raise ValueError(f"{folder.name}: llama.cpp's {arch.name} architecture has no LongRoPE")
    if cfg.num_experts and len(cfg.moe_layers) != cfg.num_hidden_layers:
        raise ValueError(f"{folder.name}: dense MLP layers among the experts' (MoE layers {list(cfg.moe_layers)}); "
                         f"llama.cpp's {arch.name} has experts in every layer")
    writer = gguf.GGUFWriter(out, arch.name, use_temp_file=True)
    _write_hparams(writer, arch, cfg, ftype, folder.name)
    _write_experts(writer, family, cfg, folder.name)
    _write_layer_shape(writer, cfg)
    _write_tokenizer(writer, folder, cfg.vocab_size)
    for name, tensor in _gguf_tensors(folder, cfg, family, arch):
        kind = _tensor_type(name, tensor.shape, qtype)
        data = tensor.to(torch.float32).numpy()
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hparams(
    writer: gguf.GGUFWriter, arch: GGUFArch, cfg: ModelConfig, ftype: LlamaFileType, name: str
) -> None:
    """The converter's `set_gguf_parameters` for these architectures."""
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch.vocab_and_rope_dims:
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch.sliding_window:
        writer.add_sliding_window(cfg.sliding_window or 0)
    for key, field in arch.multipliers:
        writer.add_float32(f"{arch.name}.{key}", getattr(cfg, field))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling.rope_type == "llama3":
        spec = {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings}
        writer.add_string(ROPE_SCALING_KEY, json.dumps(spec))
    elif scaling.rope_type == "longrope":
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
        writer.add_rope_scaling_attn_factors(cfg.rope_attention_factor)


def _write_experts(writer: gguf.GGUFWriter, family: Family, cfg: ModelConfig, name: str) -> None:
    """The converter's mixture-of-experts keys (`TextModel.set_gguf_parameters`, and qwen3moe's
    expert width), plus `expert_weights_norm` where the checkpoint renormalises otherwise than
    llama.cpp does for the architecture."""
    moe, arch = family.moe, family.gguf
    if moe is None or arch is None or not cfg.num_experts:
        return
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if moe.gguf_width_key != "feed_forward_length":
        writer.add_uint32(f"{arch.name}.{moe.gguf_width_key}", cfg.moe_intermediate_size)
    if cfg.norm_topk_prob != moe.gguf_norm:
        log.warning("%s: norm_topk_prob=%s, which llama.cpp's %s does not read (it always uses %s); written as "
                    "%s.expert_weights_norm for nanoserve", name, cfg.norm_topk_prob, arch.name, moe.gguf_norm,
                    arch.name)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)


def _every(interval: int, cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_hidden_layers) if (i + 1) % interval == 0)


def _write_layer_shape(writer: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """What a family whose layers differ from Llama's needs beyond `_write_hparams` (the keys
    `gguf_reader._layer_shape_config` reads): the final softcap, the sliding window, and where they
    differ from what llama.cpp assumes for files without them (every sixth layer global, a local
    rotary base of 10000, 1/sqrt(head_dim) attention scale), the local layers' flags, their rotary
    base and the attention scale. So a real checkpoint's file carries the converter's keys only."""
    if cfg.final_logit_softcap is not None:
        writer.add_final_logit_softcapping(cfg.final_logit_softcap)
    if not cfg.layer_windows:
        return
    window = next((w for w in cfg.layer_windows if w is not None), None)
    if window is not None:
        writer.add_sliding_window(window)
    local = [w is not None for w in cfg.layer_windows]
    if local != [(i + 1) % LOCAL_PATTERN != 0 for i in range(cfg.num_hidden_layers)]:
        writer.add_sliding_window_pattern(local)
    if cfg.local_rope_theta is not None and cfg.local_rope_theta != LOCAL_ROPE_BASE:
        writer.add_rope_freq_base_swa(cfg.local_rope_theta)
    if cfg.attention_scale != cfg.head_dim**-0.5:
        writer.add_attention_scale(cfg.attention_scale)


def _gguf_tensors(
    folder: Path, cfg: ModelConfig, family: Family, arch: GGUFArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor in GGUF layout): rope factors first (llama3 and LongRoPE scaling only),
    then every checkpoint tensor renamed, with Q/K rows permuted where the architecture stores them
    interleaved."""
    if cfg.rope_scaling.rope_type == "llama3":
        yield ROPE_FREQS, llama3_rope_factors(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_scaling.rope_type == "longrope":
        yield ROPE_FACTORS_LONG, torch.tensor(cfg.rope_scaling.long_factor, dtype=torch.float32)
        yield ROPE_FACTORS_SHORT, torch.tensor(cfg.rope_scaling.short_factor, dtype=torch.float32)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    experts: dict[str, dict[int, torch.Tensor]] = {}  # a stacked tensor's experts read so far
    for stored_name, tensor in per_expert(family, iter_safetensors(safetensors_files(folder))):
        assert isinstance(tensor, torch.Tensor)  # safetensors hold no GGUF blocks
        hf_name = family.causal_name(stored_name)
        tied_head = cfg.tie_word_embeddings and hf_name == "lm_head.weight"
        if tied_head or hf_name.endswith("rotary_emb.inv_freq"):
            continue
        ref = family.tensor_by_hf(hf_name)
        if ref is None and family.text_prefixes and hf_name == stored_name:
            continue  # a multimodal checkpoint's vision tower or projector: text only is written
        if ref is None:
            raise ValueError(f"checkpoint tensor {hf_name} has no GGUF equivalent for {cfg.family}")
        rows = ref.tensor.rows
        if arch.interleaved_rotary and rows is not None and rows in heads:
            tensor = permute_rotary(tensor, heads[rows])
        if family.layer.norm_offset and ref.tensor.param.endswith("norm.weight"):
            tensor = tensor.float() + family.layer.norm_offset
        if ref.tensor.experts:  # held until the layer's last expert of this kind is read, then stacked
            assert ref.expert is not None
            stack = experts.setdefault(ref.gguf_name, {})
            stack[ref.expert] = tensor
            if len(stack) == cfg.num_experts:
                if sorted(stack) != list(range(cfg.num_experts)):
                    raise ValueError(f"{ref.gguf_name}: experts {sorted(stack)} of {cfg.num_experts}")
                yield ref.gguf_name, torch.stack([stack[e] for e in range(cfg.num_experts)])
                del experts[ref.gguf_name]
            continue
        yield ref.gguf_name, tensor
    if experts:
        raise ValueError(f"{folder.name}: experts missing from {', '.join(sorted(experts))}")


def _tensor_type(name: str, shape: torch.Size, qtype: QType) -> QType:
    """1-D tensors, norms and MoE routers stay F32; Q8_0 and Q4_0 fall back to F16 when a row is not
    a whole number of 32-value blocks (all as in the converter)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or name.endswith("ffn_gate_inp.weight"):
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        log.warning("%s: rows of %d values do not fit %s blocks, falling back to F16",
                    name, shape[-1], qtype.name)
        return QType.F16
    return qtype


def _write_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The converter's `_set_vocab_gpt2`: one token per id up to vocab_size ([PADn] for holes),
    added tokens typed CONTROL (special, or looking like <|...|>) or USER_DEFINED."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{folder.name}: only byte-level BPE tokenizers can be written to GGUF")
    if spec.get("normalizer"):
        log.warning("%s: the tokenizer's normalizer is dropped (llama.cpp applies none)", folder.name)
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    by_id = {i: tok for tok, i in backend.get_vocab(with_added_tokens=True).items()}
    added = backend.get_added_tokens_decoder()
    tokens: list[str] = []
    types: list[TokenType] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tok = by_id[i]
        tokens.append(tok)
        if i not in added:
            types.append(TokenType.NORMAL)
        elif added[i].special or (tok.startswith("<|") and tok.endswith("|>")):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def _pre_tokenizer_name(spec: dict[str, Any]) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json whose splitting it reproduces exactly
    (the converter identifies it by hashing sample tokenizations; we compare the regex)."""
    pre = spec.get("pre_tokenizer") or {}
    regex = _split_regex(pre.get("pretokenizers", [pre]))
    ignore_merges = bool(spec["model"].get("ignore_merges"))
    for known in PRE_TOKENIZERS.values():
        if (regex,) == tuple(map(run_as, known.splits)) and known.ignore_merges == ignore_merges:
            return canonical_name(known)
    raise ValueError(f"the tokenizer's pre-tokenizer ({json.dumps(pre)[:200]}) matches no llama.cpp "
                     "pre-tokenizer (nanoserve.tokenizer.pre_tokenizers)")


def _split_regex(steps: list[dict[str, Any]]) -> str | None:
    """The regex of a byte-level pre-tokenizer: Split(regex, isolated) then ByteLevel without
    regex, or a lone ByteLevel with its built-in GPT-2 regex; None for anything else."""
    if len(steps) == 1 and _is_byte_level(steps[0], use_regex=True):
        return GPT2_REGEX
    if len(steps) == 2 and _is_byte_level(steps[1], use_regex=False):
        split = steps[0]
        if split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split.get("pattern", {}).get("Regex")
    return None


def _is_byte_level(step: dict[str, Any], *, use_regex: bool) -> bool:
    return (step.get("type") == "ByteLevel" and not step.get("add_prefix_space")
            and step.get("use_regex", True) == use_regex)
