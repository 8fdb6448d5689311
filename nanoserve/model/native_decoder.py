"""`CausalLM.forward` in one call of nanoserve's CPU kernel library (`nanoserve/csrc/decoder.cpp`).

On the CPU path every step of a layer is already a C++ call (`CpuLayerOps`, `CpuPagedAttention`),
but the Python around them (~13 calls a layer, each with its argument checks, conversions and
output tensor) costs microseconds apiece: for a single sequence, or a small draft model, as much as
the arithmetic itself. `NativeDecoder` makes the same calls, in the same order and with the same
arguments and thread count, from C++: its hidden states are bit for bit those of `CausalLM.forward`
with those backends.

It takes every step, of any number of tokens: `CpuLayerOps` sends every product to `linear.cpp` or
`quant.cpp` whatever the number of rows (batch invariance, see `nanoserve.model.layer_ops`).

It reads matrices dense in the model's dtype (`DenseWeight`), block-quantized (`BlockQuantWeight`,
by quant.cpp, as `CpuLayerOps.linear` multiplies them; a quantized embedding table's rows
dequantized as `CpuLayerOps.embed` gathers them) and stacked from up to three such parts
(`StackedWeight`, not for the embedding table): `build` declines a model with a weight in another
format (logging which), and the runner then takes the Python forward.

Invariant: the model's parameters stay where they were when the decoder was built (loaders fill
them in place before the engine is built; nothing replaces them afterwards), since it holds their
addresses.
"""

from __future__ import annotations

import ctypes
import logging
from typing import cast

import torch

from nanoserve.attention.cpu_paged import CpuPagedAttention
from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.model.decoder import CausalLM
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.moe import SparseMoE
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, StackedWeight
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight
from nanoserve.native import DTYPE_SUFFIX, LayerWeights, Matrix

log = logging.getLogger(__name__)


class NativeDecoder:
    def __init__(self, model: CausalLM, ops: CpuLayerOps) -> None:
        """Use `build`, which checks that the model and backends are the ones this replaces. Raises
        ValueError, naming the layer and the format, for a weight this cannot read."""
        cfg = model.cfg
        if not cfg.native_decoder:
            raise ValueError(f"the native decoder does not implement {cfg.family}'s layers")
        unreadable = _unreadable_weight(model)
        if unreadable is not None:
            raise ValueError(f"the native decoder cannot read {unreadable}")
        self.model = model
        self.dtype = model.dtype
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attention_scale
        self.dims = torch.tensor([cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                  cfg.head_dim, cfg.intermediate_size, cfg.num_hidden_layers], dtype=torch.int64)
        self.layers = (LayerWeights * len(model.layers))()
        for slot, layer in zip(self.layers, model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.dense_mlp
            assert layer.input_layernorm is not None and layer.post_attention_layernorm is not None
            vectors = {"input_norm": layer.input_layernorm.weight, "qkv_bias": attn.qkv_bias,
                       "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
                       "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
                       "post_norm": layer.post_attention_layernorm.weight}
            for name, param in vectors.items():
                setattr(slot, name, None if param is None else param.data_ptr())
            slot.qkv, slot.o_proj = _matrix(attn.qkv_proj), _matrix(attn.o_proj)
            slot.gate_up, slot.down = _matrix(mlp.gate_up_proj), _matrix(mlp.down_proj)
            slot.rotary = int(attn.rotary)
        self.embed = _matrix(model.embed_tokens)
        self.head = _matrix(model.head)
        self.head_rows = model.head.out_features
        self._forward = getattr(ops.lib, f"nanoserve_decoder_forward_{DTYPE_SUFFIX[self.dtype]}")
        self._draft_greedy = getattr(ops.lib, f"nanoserve_draft_greedy_{DTYPE_SUFFIX[self.dtype]}")

    @classmethod
    def build(cls, model: CausalLM, backend: AttentionBackend) -> NativeDecoder | None:
        """A decoder for `model` when its family declares one and its steps run on the C++ path
        (CpuLayerOps and the C++ attention kernel for its dtype and head size, every weight in a
        format it reads, all of its parameters and buffers contiguous CPU tensors, the parameters of
        its dtype, rotary over whole heads and q/k norms only in layers with rotary); None otherwise."""
        ops, cfg = model.ops, model.cfg
        if not (cfg.native_decoder and isinstance(ops, CpuLayerOps) and isinstance(backend, CpuPagedAttention)
                and backend.kernel.supports(model.dtype, cfg.head_dim)):
            return None
        if cfg.rotary_dim != cfg.head_dim or (cfg.qk_norm and cfg.no_rope_layers):
            log.info("no native decoder: it rotates whole heads, and normalizes q and k only with rotary")
            return None
        unreadable = _unreadable_weight(model)
        if unreadable is not None:
            log.info("no native decoder: it cannot read %s; steps take the Python forward", unreadable)
            return None
        if not all(p.is_contiguous() and p.device.type == "cpu" and p.dtype == model.dtype
                   for p in model.parameters()):
            return None
        if not all(b.is_contiguous() and b.device.type == "cpu" for b in model.buffers()):
            return None
        return cls(model, ops)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [num_tokens, hidden_size], as `CausalLM.forward` returns them.
        Raises IndexError, having written nothing, for a token id, position or slot out of range."""
        n = input_ids.shape[0]
        self._check(input_ids, positions, kv_cache, meta)
        _, _, num_blocks, block_size, _, _ = kv_cache.shape
        cos, sin = self.model.rope_tables(max(meta.seq_lens_cpu, default=0), self.dtype)
        out = torch.empty(n, self.model.cfg.hidden_size, dtype=self.dtype)
        ran = self._forward(
            self.dims.data_ptr(), self.eps, self.scale, self.layers, ctypes.byref(self.embed),
            self.model.norm.weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], kv_cache.data_ptr(),
            num_blocks, block_size, input_ids.data_ptr(), positions.data_ptr(), n, meta.slot_mapping.data_ptr(),
            meta.block_tables.data_ptr(), meta.block_tables.shape[1], meta.seq_lens.data_ptr(),
            meta.query_start_loc.data_ptr(), meta.num_seqs, out.data_ptr(), torch.get_num_threads(),
        )
        _raise_unless_ran(ran)
        return out

    def draft_greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, budgets: list[int], min_confidence: float,
                     vocab_size: int) -> list[list[int]]:
        """Greedy drafts for the sequences of a prepared step (each sequence's tokens not yet
        computed; `budgets` in the step's sequence order, each at least 1), in one call: the pass
        over the step, the LM head and the argmax over the first `vocab_size` tokens (those the
        engine samples from) at each sequence's last token, then one single-token pass per further
        draft for the sequences that have budget left and whose last draft had at least
        `min_confidence` probability (0: always). The K/V of every draft but each sequence's
        last is written at the positions after its tokens, so the block tables must cover them. The
        drafts are those of the Python loop over `__call__` and `CausalLM.compute_logits`, except
        that the confidence is computed with another exp (a draft whose probability sits at the
        threshold, to float rounding, may stop drafting on one path only) and that a NaN logit is
        never the argmax here."""
        self._check(input_ids, positions, kv_cache, meta)
        if len(budgets) != meta.num_seqs or min(budgets, default=0) < 1:
            raise ValueError("draft_greedy takes a budget of at least 1 for each sequence of the step")
        _, _, num_blocks, block_size, _, _ = kv_cache.shape
        max_budget = max(budgets)
        cos, sin = self.model.rope_tables(max(meta.seq_lens_cpu) + max_budget, self.dtype)
        budget = torch.tensor(budgets, dtype=torch.int64)
        drafts = torch.empty(len(budgets), max_budget, dtype=torch.int64)
        counts = torch.empty(len(budgets), dtype=torch.int64)
        ran = self._draft_greedy(
            self.dims.data_ptr(), self.eps, self.scale, self.layers, ctypes.byref(self.embed),
            self.model.norm.weight.data_ptr(), ctypes.byref(self.head), min(vocab_size, self.head_rows),
            cos.data_ptr(),
            sin.data_ptr(), cos.shape[0],
            kv_cache.data_ptr(), num_blocks, block_size, input_ids.data_ptr(), positions.data_ptr(),
            input_ids.shape[0], meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
            meta.block_tables.shape[1], meta.seq_lens.data_ptr(), meta.query_start_loc.data_ptr(), meta.num_seqs,
            budget.data_ptr(), max_budget, min_confidence, drafts.data_ptr(), counts.data_ptr(),
            torch.get_num_threads(),
        )
        _raise_unless_ran(ran)
        return [row[:c] for row, c in zip(drafts.tolist(), counts.tolist(), strict=True)]

    def _check(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
               meta: AttentionMetadata) -> None:
        indices = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if not all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" for t in indices):
            raise ValueError("the native decoder takes contiguous int64 CPU ids, positions and metadata")
        if kv_cache.dtype != self.dtype or not kv_cache.is_contiguous():
            raise ValueError("the native decoder takes a contiguous KV cache of the model's dtype")


def _unreadable_weight(model: CausalLM) -> str | None:
    """'<parameter> in format <format>' for the first matrix of `model` that `_matrix` cannot
    describe (the embedding table may not be stacked); None when it reads every one."""
    named: list[tuple[str, LinearWeight]] = [("embed_tokens", model.embed_tokens)]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoE):
            return f"layers.{i}.mlp, a mixture of experts"
        named += [(f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj), (f"layers.{i}.self_attn.o_proj", attn.o_proj),
                  (f"layers.{i}.mlp.gate_up_proj", mlp.gate_up_proj), (f"layers.{i}.mlp.down_proj", mlp.down_proj)]
    if model.lm_head is not None:
        named.append(("lm_head", model.lm_head))
    return next((f"{name} in format {w.format!r}" for name, w in named
                 if not _readable(w) or (name == "embed_tokens" and isinstance(w, StackedWeight))), None)


def _readable(w: LinearWeight) -> bool:
    if isinstance(w, StackedWeight):
        return len(w.parts) <= len(Matrix().parts) and all(_readable(p) and not isinstance(p, StackedWeight)
                                                           for p in w.parts)
    return isinstance(w, DenseWeight | BlockQuantWeight)


def _matrix(w: LinearWeight) -> Matrix:
    """kernels.h's Matrix of a weight that `_readable` passed (its tensors stay the model's)."""
    matrix = Matrix()
    parts = w.parts if isinstance(w, StackedWeight) else [w]
    matrix.num_parts = len(parts)
    for slot, part in zip(matrix.parts, parts, strict=False):
        slot.rows = part.out_features
        if isinstance(part, BlockQuantWeight):
            slot.data, slot.qtype = part.blocks.data_ptr(), int(BLOCK_FORMATS[part.format].qtype)
        else:
            slot.data, slot.qtype = cast(DenseWeight, part).weight.data_ptr(), -1
    return matrix


def _raise_unless_ran(code: int) -> None:
    if code != 1:
        what = {-1: "a token id outside the vocabulary", -2: "a position outside the rotary tables"}
        raise IndexError(f"native decoder: {what.get(code, 'a slot outside the KV pool')}")
