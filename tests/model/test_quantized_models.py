"""Quantized weights kept quantized: GGUF files whose matrices are Q8_0, Q4_0 or k-quants load with
those blocks as the model's storage (bytes held = the file's tensor bytes), `--quantization int8`
quantizes a safetensors checkpoint's layer matrices to Q8_0 at load, and both compute what the same
model with the dequantized values as dense weights computes.

Every comparison runs the quantized model on the layer ops the engine picks (`select_layer_ops`:
nanoserve's C++ products on this CPU) against the dense model holding the dequantized values, in
fp32. The products quantize activations to int8 as llama.cpp does, in blocks of 32 (Q8_0), for the
k-quants in their super-blocks of 256 (q8_K): an activation moves by at most half its block's step
s = max|x_block| / 127, uniformly, so by s / sqrt(12) RMS; the largest of 32 Gaussian values is
about 2.5 standard deviations, so each product's relative RMS error is about 2.5 / 127 / sqrt(12) =
0.57% (measured 0.50-0.58% per product, every format), more with 256 values a step and these
models' uneven channels. Nine products deep (two layers and the LM head), with the norms between,
the logits' relative RMS error measured 1.5-2.0% on the Q8_0 / Q4_0 models and 2.7-5.2% on the
k-quant ones, one token per step (a prefill of many rows takes the same int8 products, row by row
the same bits). LOGIT_TOLERANCE and K_LOGIT_TOLERANCE leave about 2x over that. A wrong block
layout, scale or row order gives ~100%.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import nanoserve
from nanoserve import LLM, SamplingParams
from nanoserve.cli import main as cli_main
from nanoserve.model import CausalLM, LoadedModel, load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.checkpoint.gguf_reader import read_gguf
from nanoserve.model.checkpoint.loader import place_on_huge_pages
from nanoserve.model.checkpoint.weights import load_weights
from nanoserve.model.families import FAMILIES as REGISTRY
from nanoserve.model.layer_ops import select_layer_ops
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight, StackedWeight
from nanoserve.model.quant.weight_formats import DenseWeight, LinearWeight

from support.families import FAMILIES
from support.forward import forward_chunks, full_logits

LOGIT_TOLERANCE = 0.05  # relative RMS logit error against the dequantized dense model (see the docstring)
K_LOGIT_TOLERANCE = 0.1  # the same for models with k-quant matrices (one activation step per 256 values)
# Relative RMS logit error (|L - L_ref| / |L_ref| over all positions) against the fp32 safetensors
# model the file was made from: the weights' own quantization error. Measured on llama: Q8_0 0.018,
# Q4_0 0.31; the same model with its Q rows left in llama.cpp's rotary order gives 0.76.
SOURCE_TOLERANCE = {"q8_0": 0.05, "q4_0": 0.5}
MEMORY_SLACK = 0.15  # parameter + buffer bytes within 15% of the GGUF file's tensor bytes
LOAD_PEAK_SLACK = 0.15  # a load's peak resident growth within 15% of the file's size ...
LOAD_PEAK_ALLOWANCE = 6 << 20  # ... plus these bytes (config, tokenizer), whatever the file
LENGTHS = (1, 5, 23, 64)
GREEDY_TOKENS = 12
# Greedy runs of the quantized and the dense model are equal for STRICT_TOKENS tokens (measured:
# equal for 4 to 9 tokens); beyond, these tiny random models' near-ties (logits RMS ~1 over ~3800
# tokens) may flip, so along the quantized model's whole run the dense model's logit of each token
# chosen is within TIE_MARGIN of its best (the logit noise above is ~0.05 RMS; a wrong token sits ~3
# below the best). The strict part stops early at a step whose dense top two logits are within
# NEAR_TIE (twice that noise) of each other: either choice there is the products' rounding.
STRICT_TOKENS = 4
TIE_MARGIN = 0.25
NEAR_TIE = 0.1
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
PROMPT_IDS = [9, 1721, 355, 2048, 77, 3001, 14, 600]
# K-quant files need rows of whole 256-value blocks: hidden and intermediate sizes of 256 and 512,
# and a head size of 64 (so Qwen3's o_proj rows, num_heads * head_dim, are 256 long).
K_SHAPE = {"hidden_size": 256, "intermediate_size": 512}
# A Q4_K_M-like mix (llama.cpp's Q4_K_M keeps attn_v and some ffn_down in Q6_K, the LM head in
# Q6_K): per layer, the type of each matrix that is not Q4_K. Layer 1's o_proj is Q5_K, its up
# Q5_K, so q/k/v of layer 0 and gate/up of layer 1 are stacked from two formats.
K_MIX = {0: {"attn_v": QType.Q6_K, "ffn_down": QType.Q6_K}, 1: {"attn_output": QType.Q5_K, "ffn_up": QType.Q5_K}}
# The fp16 block scales of random blocks of the types gguf-py cannot quantize to, {byte offset: value}:
# d (and dmin centring the values of q4_k / q5_k / q2_k) giving weights of standard deviation about 0.1.
K_SCALES = {QType.Q4_K: {0: 3.9e-4, 2: 3.9e-4 * 7.5}, QType.Q5_K: {0: 1.9e-4, 2: 1.9e-4 * 15.5},
            QType.Q6_K: {208: 7.3e-5}, QType.IQ4_NL: {0: 1.4e-3}, QType.IQ4_XS: {0: 9e-5}, QType.Q3_K: {108: 2.7e-3},
            QType.Q2_K: {80: 8e-3, 82: 1.2e-2}}
# A file of the other block types, each in two places (llama's matrices, the embedding and the LM
# head): per layer, the type of each matrix; q/k/v and gate/up stacked from three and two formats.
OTHER_MIX = {0: {"attn_q": QType.Q4_1, "attn_k": QType.Q5_0, "attn_v": QType.Q5_1, "attn_output": QType.IQ4_NL,
                 "ffn_gate": QType.IQ4_XS, "ffn_up": QType.Q3_K, "ffn_down": QType.Q2_K},
             1: {"attn_q": QType.IQ4_XS, "attn_k": QType.Q3_K, "attn_v": QType.Q2_K, "attn_output": QType.Q4_1,
                 "ffn_gate": QType.Q5_0, "ffn_up": QType.Q5_1, "ffn_down": QType.IQ4_NL}}
# Share of the steps of llama.cpp's greedy runs on a Q8_0 file where ours picks its token. Measured
# 48, 48, 47 and 46 of 48 (llama, qwen2, qwen3, mistral); free runs agree on 48, 48, 24, 28.
LLAMA_CPP_AGREEMENT = 0.9


def _k_shape(family: str) -> dict[str, Any]:
    return {**K_SHAPE, "head_dim": 64} if family == "qwen3" else dict(K_SHAPE)


def _k_type(name: str) -> QType:
    """The type of GGUF tensor `name` in the K_MIX file."""
    if name == "output.weight":
        return QType.Q6_K
    if name.startswith("blk."):
        layer, tensor = name.split(".")[1:3]
        return K_MIX.get(int(layer), {}).get(tensor, QType.Q4_K)
    return QType.Q4_K


def _other_type(name: str) -> QType:
    """The type of GGUF tensor `name` in the OTHER_MIX file."""
    if name == "output.weight":
        return QType.Q3_K
    if name.startswith("blk."):
        layer, tensor = name.split(".")[1:3]
        return OTHER_MIX[int(layer)][tensor]
    return QType.IQ4_NL


def _random_k_blocks(rows: int, in_features: int, kind: QType, gen: torch.Generator) -> np.ndarray:
    """Valid random blocks of a type in K_SCALES: random quants, sub-block scales and mins, with the
    fp16 block scales set to K_SCALES."""
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = torch.randint(0, 256, (rows, in_features // block, type_size), generator=gen, dtype=torch.uint8)
    for at, value in K_SCALES[kind].items():
        raw[..., at:at + 2] = torch.tensor([value], dtype=torch.float16).view(torch.uint8)
    return raw.reshape(rows, -1).numpy()


def _retyped(src: Path, dst: Path, kind_of: Callable[[str], QType]) -> Path:
    """A copy of the F32 GGUF file `src` with each matrix stored as `kind_of(name)`: quantized from its
    values where gguf-py has a quantizer, as random valid blocks (K_SCALES) where it has none."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    gen = torch.Generator().manual_seed(19)
    for t in reader.tensors:
        if t.data.ndim != 2:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        kind = kind_of(t.name)
        data = _random_k_blocks(*t.data.shape, kind, gen) if kind in K_SCALES else gguf.quants.quantize(t.data, kind)
        writer.add_tensor(t.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def gguf_file(make_checkpoint: Callable[..., Path],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """(family, "Q8_0" | "Q4_0" | "K_MIX" | "OTHER_MIX") -> (safetensors folder, GGUF file), built once
    each."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(family: str, kind: str) -> tuple[Path, Path]:
        if (family, kind) not in cache:
            out = tmp_path_factory.mktemp("quant")
            if kind in ("K_MIX", "OTHER_MIX"):
                src = make_checkpoint(family, **_k_shape(family))
                path = _retyped(export_gguf(src, out / "f32.gguf"), out / f"{family}-{kind}.gguf",
                                _k_type if kind == "K_MIX" else _other_type)
            else:
                src = make_checkpoint(family)
                path = export_gguf(src, out / f"{family}-{kind}.gguf", kind)
            cache[family, kind] = src, path
        return cache[family, kind]

    return make


def _seqs(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _on_engine_ops(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with the layer ops the engine picks on this CPU for its dtype."""
    loaded.model.ops = select_layer_ops("auto", torch.device("cpu"), loaded.model.dtype)
    return loaded


def _dequantized(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The GGUF file's model with every matrix dense: the dequantized values (through the loader's
    path for destinations that keep no blocks)."""
    ckpt = read_gguf(path)
    quantized = load_model(path, dtype=dtype)
    model = CausalLM(quantized.config, dtype)
    load_weights(model, ckpt.weights(dtype), REGISTRY[quantized.config.family])
    return _on_engine_ops(LoadedModel(model, quantized.config, quantized.tokenizer, path, {}))


def _relative_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    r, g = torch.cat(ref), torch.cat(got)
    return ((g - r).norm() / r.norm()).item()


def _formats(model: torch.nn.Module) -> dict[str, str]:
    """name -> format of every matrix of `model` (a stacked one as "a+b", its parts' formats)."""
    out = {}
    for name, w in model.named_modules():
        if isinstance(w, LinearWeight) and ".stack." not in name:
            out[name] = "+".join(p.format for p in w.parts) if isinstance(w, StackedWeight) else w.format
    return out


def _held_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def _greedy(loaded: LoadedModel, prompt: str | list[int] = PROMPT) -> list[int]:
    llm = LLM(loaded=loaded, max_model_len=128)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    return list(out[0].outputs[0].token_ids)


def _check_logits(quantized: LoadedModel, dense: LoadedModel) -> None:
    """Logits within LOGIT_TOLERANCE (K_LOGIT_TOLERANCE with k-quant matrices) of the dense model's,
    in one prefill of whole sequences (many rows) and one token per sequence and step (a few rows),
    both through the int8 products."""
    k_quants = any(f.endswith("_k") for fmts in _formats(quantized.model).values() for f in fmts.split("+"))
    tolerance = K_LOGIT_TOLERANCE if k_quants else LOGIT_TOLERANCE
    seqs = _seqs(quantized.config.vocab_size)
    assert _relative_error(full_logits(dense, seqs), full_logits(quantized, seqs)) < tolerance
    steps = [[[t] for t in seq] for seq in seqs]
    assert _relative_error(forward_chunks(dense, steps), forward_chunks(quantized, steps)) < tolerance


def _check_greedy(quantized: LoadedModel, dense: LoadedModel, strict_tokens: int = STRICT_TOKENS) -> None:
    """The greedy runs agree (see STRICT_TOKENS, NEAR_TIE and TIE_MARGIN)."""
    run, reference = _greedy(quantized, PROMPT_IDS), _greedy(dense, PROMPT_IDS)
    top2 = full_logits(dense, [PROMPT_IDS + reference])[0][len(PROMPT_IDS) - 1:-1].topk(2, dim=1).values
    ties = (top2[:, 0] - top2[:, 1] < NEAR_TIE).nonzero().flatten().tolist()
    strict = min([strict_tokens, *ties])
    assert run[:strict] == reference[:strict]
    logits = full_logits(dense, [PROMPT_IDS + run])[0][len(PROMPT_IDS) - 1:-1]
    regret = logits.max(dim=1).values - logits[torch.arange(len(run)), run]
    assert regret.max().item() < TIE_MARGIN, regret


def _check_against_dequantized(path: Path, all_kept: bool = True) -> LoadedModel:
    """Loads `path` kept quantized and checks logits and greedy tokens against the dequantized
    dense model and, when every matrix is of a kept type (`all_kept`), the bytes held against the
    file's; returns the quantized model."""
    quantized = _on_engine_ops(load_model(path, dtype=torch.float32))
    dense = _dequantized(path)
    _check_logits(quantized, dense)
    _check_greedy(quantized, dense)
    held, file_bytes = _held_bytes(quantized.model), _file_tensor_bytes(path)
    if not all_kept:
        return quantized
    assert abs(held - file_bytes) <= MEMORY_SLACK * file_bytes, (held, file_bytes)
    assert _held_bytes(dense.model) > 3 * file_bytes  # the dense fp32 model, for scale
    return quantized


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_quantized_file_kept_quantized(gguf_file, family, kind):
    src, path = gguf_file(family, kind)
    loaded = _check_against_dequantized(path)
    fmt = kind.lower()
    formats = _formats(loaded.model)
    assert set(formats.values()) == {fmt}, formats  # every matrix, the embedding and LM head included
    # The loader wrote every weight into one map (place_on_huge_pages) and the logits below hold.
    state = loaded.model.state_dict()
    assert len({t.untyped_storage().data_ptr() for t in state.values()}) == 1
    if THP.exists() and "[never]" not in THP.read_text():
        assert "hg" in _vma_flags(next(iter(state.values())).data_ptr())
    # Within the weights' own quantization error of the checkpoint the file was made from (llama's
    # Q/K rows un-permuted from blocks correctly, or this fails by ~1).
    reference = load_model(src, dtype=torch.float32)
    seqs = _seqs(loaded.config.vocab_size)
    assert _relative_error(full_logits(reference, seqs), full_logits(loaded, seqs)) < SOURCE_TOLERANCE[fmt]


# Run in a fresh interpreter: loads the file once (lazy imports, tokenizer, allocator warmed up), then
# again after resetting the peak; prints resident bytes before and at the peak of the second load.
_LOAD_PEAK = """
import gc, sys, torch
from nanoserve.model import load_model
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
torch.set_num_threads(1)
load_model(sys.argv[1], dtype=torch.float32, quantization=sys.argv[2])
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmRSS")
model = load_model(sys.argv[1], dtype=torch.float32, quantization=sys.argv[2])
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.model.parameters(), *model.model.buffers()]}
print(before, status("VmHWM"), sum(storages.values()))
"""


def _load_peak(path: Path, quantization: str = "none") -> tuple[int, int]:
    """(the loaded model's tensor bytes, peak resident growth while loading) of a second load of
    `path` in a fresh interpreter running this checkout's nanoserve. (Resident growth once loaded is
    no measure of the model: the first load's freed memory is reused.) glibc's mmap threshold is
    fixed at its initial 128 KiB: left dynamic, it rises as large blocks are freed, and how much of
    the first load's freed heap the second one's transient tensors reuse then varied from run to run
    (the int8 load below grew 36-47 MB with the weights allocated by torch, 54-64 MB with them in one
    huge-page map; 50 and 52 MB, steadily, with the threshold fixed)."""
    env = {**os.environ, "PYTHONPATH": str(Path(nanoserve.__file__).parents[1]), "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, str(path), quantization], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout
    before, peak, model_bytes = map(int, out.split())
    return model_bytes, peak - before


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets Linux's peak RSS (VmHWM)")
def test_gguf_load_peak_near_file_size(make_checkpoint, tmp_path):
    """Loading a Q8_0 file (llama: Q/K rows un-permuted on the way) peaks near the file's size: each
    tensor's mapped pages are dropped once copied, so the file is not held beside its copy (before
    that, this load peaked at 1.6x the file)."""
    src = make_checkpoint("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6)
    path = export_gguf(src, tmp_path / "llama-q8_0.gguf", "Q8_0")
    size = path.stat().st_size
    assert size > 20 << 20  # large enough for the allowance to be small beside it
    _, peak = _load_peak(path)
    assert peak <= (1 + LOAD_PEAK_SLACK) * size + LOAD_PEAK_ALLOWANCE, (peak, size)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets Linux's peak RSS (VmHWM)")
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_safetensors_load_peak_near_what_it_loads(make_checkpoint, quantization):
    """A safetensors checkpoint's load peaks near the model it fills (fp32: the file's size; int8:
    less), not at the file beside it: each tensor is read into memory of its own, no shard stays
    mapped (with the safetensors library's memory map, fp32 peaked at ~2x the file)."""
    src = make_checkpoint("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=6)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert size > 40 << 20  # large enough for the allowance to be small beside it
    model_bytes, peak = _load_peak(src, quantization)
    assert model_bytes <= size  # int8: the layers' blocks take less than their fp32 source
    assert peak <= model_bytes + LOAD_PEAK_SLACK * size + LOAD_PEAK_ALLOWANCE, (peak, model_bytes, size)


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="needs Linux's transparent huge pages")
def test_weights_placed_on_huge_pages():
    """Every CPU parameter and persistent buffer, small ones included, gets zeroed memory in one
    mapping marked for huge pages ("hg"), 64-byte aligned; tensors that shared a storage (tied
    weights, views) still share it; non-persistent buffers keep their memory and values."""
    module = torch.nn.Linear(300, 7, dtype=torch.bfloat16)  # 4.2 KB of weights: heap memory of its own
    module.register_buffer("blocks", torch.randint(1, 256, (1000, 144), dtype=torch.uint8))
    module.register_buffer("tied", module.blocks[10:20])
    module.register_buffer("inv_freq", torch.arange(1.0, 9.0), persistent=False)
    computed = module.inv_freq
    assert place_on_huge_pages(module) == sum(-(-n // 64) * 64 for n in (300 * 7 * 2, 7 * 2, 1000 * 144))
    state = module.state_dict()
    assert set(state) == {"weight", "bias", "blocks", "tied"}
    assert all(not t.any() for t in state.values())
    assert {t.untyped_storage().data_ptr() for t in state.values()} == {module.blocks.untyped_storage().data_ptr()}
    assert module.tied.data_ptr() == module.blocks.data_ptr() + 10 * 144
    assert all(t.data_ptr() % 64 == 0 for name, t in state.items() if name != "tied")
    assert all("hg" in _vma_flags(t.data_ptr()) for t in state.values())
    assert isinstance(module.weight, torch.nn.Parameter)
    assert module.inv_freq is computed and torch.equal(computed, torch.arange(1.0, 9.0))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_k_quant_mix_kept_quantized(gguf_file, family):
    """A Q4_K_M-like file: q4_k, q5_k and q6_k matrices, fused q/k/v and gate/up stacked where their
    parts differ in format."""
    _, path = gguf_file(family, "K_MIX")
    loaded = _check_against_dequantized(path)
    formats = _formats(loaded.model)
    assert formats["layers.0.self_attn.qkv_proj"] == "q4_k+q6_k"  # q and k merged into one part
    assert formats["layers.0.mlp.down_proj"] == "q6_k"
    assert formats["layers.1.self_attn.qkv_proj"] == "q4_k"
    assert formats["layers.1.self_attn.o_proj"] == "q5_k"
    assert formats["layers.1.mlp.gate_up_proj"] == "q4_k+q5_k"
    assert formats["embed_tokens"] == "q4_k"
    assert formats.get("lm_head", "q6_k") == "q6_k"  # absent when tied to the embedding


def test_other_block_types_kept_quantized(gguf_file, caplog):
    """A file of Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q3_K and Q2_K matrices loads with every one kept
    in its blocks (no conversion line) and computes what the dequantized model computes."""
    _, path = gguf_file("llama", "OTHER_MIX")
    with caplog.at_level(logging.INFO, logger="nanoserve.model.checkpoint.gguf_reader"):
        loaded = _check_against_dequantized(path)
    assert not [r.message for r in caplog.records if r.name == "nanoserve.model.checkpoint.gguf_reader"]
    formats = _formats(loaded.model)
    assert formats["layers.0.self_attn.qkv_proj"] == "q4_1+q5_0+q5_1"
    assert formats["layers.0.self_attn.o_proj"] == "iq4_nl"
    assert formats["layers.0.mlp.gate_up_proj"] == "iq4_xs+q3_k"
    assert formats["layers.0.mlp.down_proj"] == "q2_k"
    assert formats["layers.1.self_attn.qkv_proj"] == "iq4_xs+q3_k+q2_k"
    assert formats["layers.1.self_attn.o_proj"] == "q4_1"
    assert formats["layers.1.mlp.gate_up_proj"] == "q5_0+q5_1"
    assert formats["layers.1.mlp.down_proj"] == "iq4_nl"
    assert formats["embed_tokens"] == "iq4_nl"
    assert formats["lm_head"] == "q3_k"


def test_tied_quantized_embedding_is_the_head(gguf_file):
    """A tied Q8_0 token_embd stays one quantized table: gathered for inputs, multiplied as the head."""
    _, path = gguf_file("qwen2", "Q8_0")
    model = load_model(path, dtype=torch.float32).model
    assert model.lm_head is None and isinstance(model.embed_tokens, BlockQuantWeight)
    assert model.head is model.embed_tokens


def test_other_types_dequantized_with_one_log_line(gguf_file, tmp_path, caplog):
    """Matrices of types without a block product (TQ2_0 here, F16 there) are dense in the model's
    dtype, next to the kept ones; one log line names them."""
    src, _ = gguf_file("llama", "K_MIX")
    mixed = _retyped(export_gguf(src, tmp_path / "f32.gguf"), tmp_path / "mixed.gguf",
                     lambda name: QType.TQ2_0 if "ffn" in name else QType.F16 if "attn_output" in name else QType.Q8_0)
    with caplog.at_level(logging.INFO, logger="nanoserve.model.checkpoint.gguf_reader"):
        load_model(mixed, dtype=torch.float32)
    loaded = _check_against_dequantized(mixed, all_kept=False)
    assert [r.message for r in caplog.records if r.name == "nanoserve.model.checkpoint.gguf_reader"] == [
        "mixed.gguf: converting F16, TQ2_0 tensors to the model's dtype at load "
        "(nanoserve multiplies Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, Q2_K blocks)"]
    formats = _formats(loaded.model)
    assert formats["layers.0.mlp.gate_up_proj"] == formats["layers.0.self_attn.o_proj"] == "dense"
    assert formats["layers.0.self_attn.qkv_proj"] == formats["embed_tokens"] == "q8_0"
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, DenseWeight) and down.weight.dtype == torch.float32


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_int8_quantizes_safetensors_layers(make_checkpoint, gguf_file, family):
    """--quantization int8: the layer matrices become Q8_0 blocks, byte for byte those of the Q8_0
    GGUF file written from the same checkpoint (one reference quantizer); the embedding, LM head
    and norms stay in --dtype. Logits stay within the Q8_0 error of the checkpoint."""
    src, q8_path = gguf_file(family, "Q8_0")
    int8 = _on_engine_ops(load_model(src, dtype=torch.float32, quantization="int8"))
    formats = _formats(int8.model)
    assert {k: v for k, v in formats.items() if k.startswith("layers.")} == {
        f"layers.{i}.{p}": "q8_0" for i in range(2)
        for p in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert {formats["embed_tokens"], formats.get("lm_head", "dense")} == {"dense"}
    assert int8.model.layers[0].input_layernorm.weight.dtype == torch.float32
    from_file = load_model(q8_path, dtype=torch.float32).model
    for name, w in int8.model.named_modules():
        if isinstance(w, BlockQuantWeight):
            assert torch.equal(w.blocks, from_file.get_submodule(name).blocks), name
    reference = load_model(src, dtype=torch.float32)
    seqs = _seqs(int8.config.vocab_size)
    assert _relative_error(full_logits(reference, seqs), full_logits(int8, seqs)) < SOURCE_TOLERANCE["q8_0"]


def test_int8_served_end_to_end(make_checkpoint, gguf_file, capsys):
    """Through `LLM` in bf16 activations (the engine's layer ops) and through `nanoserve generate`:
    the tokens of the same model with the dequantized weights dense."""
    src = make_checkpoint("qwen2")
    llm = LLM(str(src), dtype="bfloat16", quantization="int8", max_model_len=128)
    model = llm.engine.runner.model
    assert isinstance(model, CausalLM) and isinstance(model.layers[0].mlp.down_proj, BlockQuantWeight)
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    assert len(llm.generate(PROMPT, params)[0].outputs[0].token_ids) == GREEDY_TOKENS
    quantized = load_model(src, dtype="bfloat16", quantization="int8")
    dense = load_model(src, dtype="bfloat16", quantization="int8")
    for layer in dense.model.layers:  # the same values, dense
        for owner, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                            (layer.mlp, "down_proj")):
            w = getattr(owner, attr)
            setattr(owner, attr, DenseWeight(_dense_values(w, torch.bfloat16)))
    _check_logits(_on_engine_ops(quantized), _on_engine_ops(dense))
    # bf16 logits of magnitude 2-4 are multiples of 2^-6: exact ties happen, so no run is strict.
    _check_greedy(quantized, dense, strict_tokens=0)
    assert cli_main(["generate", str(src), "--quantization", "int8", "--dtype", "float32", "--prompt", PROMPT,
                     "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def _dense_values(w: LinearWeight, dtype: torch.dtype) -> torch.Tensor:
    from nanoserve.model.quant.block_quant import dequantize

    assert isinstance(w, BlockQuantWeight)
    return dequantize(w, dtype)


def test_quantization_flag_errors(gguf_file, capsys):
    """An unknown method is a CLI error naming the choices; a GGUF file's formats are its own:
    --quantization must be none or what the file holds."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--quantization", "int4", "--prompt", "x"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int4' (choose from 'none', 'int8', 'dense')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization must be one of none, int8"):
        LLM(None, quantization="fp8")
    _, q4 = gguf_file("llama", "Q4_0")
    with pytest.raises(ValueError, match=r"--quantization int8 does not apply to llama-Q4_0.gguf.*\(q4_0\)"):
        load_model(q4, dtype=torch.float32, quantization="int8")
    _, q8 = gguf_file("llama", "Q8_0")
    assert set(_formats(load_model(q8, dtype=torch.float32, quantization="int8").model).values()) == {"q8_0"}


def test_off_cpu_weights_are_dequantized(gguf_file, caplog):
    """No GPU kernel takes blocks yet: on another device (here `meta`, which holds no data) every
    matrix is dense, with one log line saying so."""
    _, path = gguf_file("qwen3", "Q4_0")
    with caplog.at_level(logging.INFO, logger="nanoserve.model.checkpoint.loader"):
        loaded = load_model(path, dtype=torch.float32, device="meta")
    assert set(_formats(loaded.model).values()) == {"dense"}
    assert "qwen3-Q4_0.gguf: no meta kernel for q4_0 weights yet; dequantizing them to float32 at load" in [
        r.message for r in caplog.records]


def _llama_cpp_greedy(path: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """llama.cpp's greedy continuation (GREEDY_TOKENS, EOS ignored) of each prompt: the prompt in one
    `eval`, then the argmax of the last logits, as nanoserve.bench.peers runs it. Without ggml's
    extra buffer types: their AMX Q8_0 product crashes in this build on CPUs with AMX."""
    import llama_cpp

    defaults = llama_cpp.llama_model_default_params

    def plain_cpu() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    monkeypatch.setattr(llama_cpp.llama.llama_cpp, "llama_model_default_params", plain_cpu)
    ref = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, n_threads_batch=1, logits_all=True, verbose=False)
    out = []
    for ids in prompts:
        ref.reset()
        ref.eval(ids)
        tokens: list[int] = []
        while len(tokens) < GREEDY_TOKENS:
            tokens.append(int(np.argmax(ref.scores[ref.n_tokens - 1])))
            ref.eval(tokens[-1:])
        out.append(tokens)
    return out


@pytest.mark.peers
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is in the bench extra")
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_agrees_with_llama_cpp_on_q8_0(gguf_file, family, monkeypatch):
    """llama.cpp's greedy continuations of the same token ids on the same Q8_0 file. Both quantize
    activations to Q8_0 blocks, but llama.cpp keeps K/V in fp16 and sums in another order: its
    logits differ from ours by 1.3-1.6% relative RMS (0.03% on the F32 file), and these tiny random
    models have many near-ties, so free runs part after a near-tie. Checked along llama.cpp's runs
    (our model fed its tokens): our greedy choice equals its token at LLAMA_CPP_AGREEMENT of the
    steps, and where it does not, its token is within TIE_MARGIN of our best."""
    _, path = gguf_file(family, "Q8_0")
    ours = _on_engine_ops(load_model(path, dtype=torch.float32))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (3, 8, 17, 30)]
    runs = _llama_cpp_greedy(path, prompts, monkeypatch)
    agreed = 0
    for ids, run in zip(prompts, runs, strict=True):
        logits = forward_chunks(ours, [[ids, *([t] for t in run[:-1])]])[0][len(ids) - 1:]
        agreed += int((logits.argmax(dim=1) == torch.tensor(run)).sum())
        regret = logits.max(dim=1).values - logits[torch.arange(len(run)), run]
        assert regret.max().item() < TIE_MARGIN, regret
    assert agreed / (GREEDY_TOKENS * len(prompts)) >= LLAMA_CPP_AGREEMENT, f"{agreed}/{GREEDY_TOKENS * len(prompts)}"


@pytest.mark.peers
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is in the bench extra")
def test_llama_cpp_q4_k_m_file(make_checkpoint, tmp_path):
    """A Q4_K_M file made by llama.cpp's own quantizer from our F32 export: kept as its k-quants,
    computing what its dequantized weights compute."""
    import llama_cpp

    src = make_checkpoint("llama", **K_SHAPE)
    f32 = export_gguf(src, tmp_path / "f32.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    out = tmp_path / "q4_k_m.gguf"
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
    loaded = _check_against_dequantized(out)
    kept = set(_formats(loaded.model).values())
    assert {"q4_k", "q6_k"} <= {f for v in kept for f in v.split("+")} <= {*BLOCK_FORMATS, "dense"}
