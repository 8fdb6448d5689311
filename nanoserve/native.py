"""nanoserve's CPU kernel library: the C++ in `csrc/`, compiled at first use and loaded with ctypes.

The sources (`paged_attention.cpp`, `layer_ops.cpp`, `linear.cpp`, `quant.cpp` (products with GGUF
block-quantized weights), and `decoder.cpp`, which composes the others; headers `simd.h` and
`kernels.h`, and quant.cpp's own `quant_isa.h`, `quant_blocks.h` and `quant_dot.h`)
include no torch header and need no ninja: one `g++ -O3 -march=native -fopenmp` call builds them.
The instruction set flags (`-march=native` by default) are a parameter, so that tests can build the
same sources for an older CPU (e.g. without VNNI) beside the native build.
OpenMP resolves to the libgomp that torch has already loaded (same soname). The library goes to
$NANOSERVE_CACHE/kernels under a name that hashes the sources, the flags, the compiler's version and
the CPU's feature flags (it is built for the CPU it runs on); it is written under a temporary name
and renamed into place, so a concurrent process sees either no file or a whole one.

`kernels.h` declares every entry point (each source includes it, so a definition that drifts from
its declaration fails to compile); `SIGNATURES` here gives each its ctypes result and argument
types, set on the library once when it is loaded, so callers take a function with `getattr(lib,
name)` (ctypes keeps that object on the library) and call it.

Invariants: `load_cpu_kernels` returns a loaded library or None (with a warning saying why); it
never raises for a missing or failing compiler, so callers can fall back to torch. It loads the
library once per process for each compiler and cache folder (a loaded shared library is global to
the process anyway), and asks the compiler its version and hashes the sources once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve.cache import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in (
    "paged_attention.cpp", "layer_ops.cpp", "linear.cpp", "quant.cpp", "decoder.cpp"))
HEADERS = tuple(CSRC / name for name in (
    "simd.h", "kernels.h", "quant_isa.h", "quant_blocks.h", "quant_dot.h"))
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
NATIVE_ISA = ("-march=native",)  # the instruction set flags of the build for this CPU
# The element types the kernels are built for, and the suffix of each entry point's name.
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class MatrixPart(ctypes.Structure):
    """kernels.h's MatrixPart: `rows` rows of a matrix, dense in the model's dtype (qtype -1) or GGUF
    blocks of type `qtype`, at `data`."""

    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("qtype", ctypes.c_int64)]


class Matrix(ctypes.Structure):
    """kernels.h's Matrix: one to three MatrixParts stacked by rows."""

    _fields_ = [("parts", MatrixPart * 3), ("num_parts", ctypes.c_int64)]


class LayerWeights(ctypes.Structure):
    """kernels.h's LayerWeights: one decoder layer's vector addresses (None for a parameter the
    family lacks) and matrices."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("qkv", Matrix), ("qkv_bias", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("o_proj", Matrix),
                ("post_norm", ctypes.c_void_p), ("gate_up", Matrix), ("down", Matrix)]


class Signature(NamedTuple):
    restype: type | None
    argtypes: tuple[type, ...]


_PTR, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_LAYERS = ctypes.POINTER(LayerWeights)

# Every entry point that kernels.h declares once per element type, as `name_<DTYPE_SUFFIX>`: the
# declaration's result and parameters in order (a pointer of any element type is _PTR; int64_t _I64,
# int _INT, float _F32).
_PER_DTYPE = {
    # layer_ops.cpp
    "nanoserve_rms_norm": Signature(None, (_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _INT)),
    "nanoserve_qk_norm_rope": Signature(None, (_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _F32,
                                               _INT)),
    "nanoserve_silu_mul": Signature(None, (_PTR, _PTR, _I64, _I64, _INT)),
    # linear.cpp
    "nanoserve_linear": Signature(None, (_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT)),
    # quant.cpp
    "nanoserve_quant_linear": Signature(_INT, (_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT)),
    "nanoserve_dequantize_rows": Signature(_INT, (_PTR, _INT, _I64, _I64, _PTR, _I64, _PTR, _INT)),
    # paged_attention.cpp
    "nanoserve_paged_attention": Signature(_INT, (_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                  _I64, _I64, _I64, _F32, _INT)),
    "nanoserve_write_kv": Signature(_INT, (_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64)),
    # decoder.cpp
    "nanoserve_decoder_forward": Signature(_INT, (
        _PTR, _F32, _F32, _LAYERS, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64,
        _PTR, _PTR, _I64, _PTR, _INT)),
    "nanoserve_draft_greedy": Signature(_INT, (
        _PTR, _F32, _F32, _LAYERS, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR,
        _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _F32, _PTR, _PTR, _INT)),
}
# The ctypes signature of every entry point of the library, by name.
SIGNATURES: dict[str, Signature] = {
    **{f"{name}_{suffix}": sig for name, sig in _PER_DTYPE.items() for suffix in DTYPE_SUFFIX.values()},
    # linear.cpp, quant.cpp: bf16 products with fp32 outputs (the LM head)
    "nanoserve_linear_bf16_out_f32": _PER_DTYPE["nanoserve_linear"],
    "nanoserve_quant_linear_bf16_out_f32": _PER_DTYPE["nanoserve_quant_linear"],
    "nanoserve_linear_bf16_native": Signature(_INT, ()),  # linear.cpp
    "nanoserve_quant_isa": Signature(_INT, ()),  # quant.cpp
}


def load_cpu_kernels(cache_dir: Path | None = None, isa: tuple[str, ...] = NATIVE_ISA) -> ctypes.CDLL | None:
    """The library (compiled first if this machine has no build of the current sources yet), its
    entry points declared as `SIGNATURES` says; None (with a warning) when it cannot be built or
    loaded. `isa`: the instruction set flags to build for (a CPU this one can run). Cached: later
    calls with the same compiler ($CXX), cache folder and flags return the same object."""
    return _load(os.environ.get("CXX", "g++"), (cache_dir or cache_root()) / "kernels", isa)


@functools.cache
def _load(compiler: str, folder: Path, isa: tuple[str, ...]) -> ctypes.CDLL | None:
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s) found; nanoserve's CPU kernels are off", compiler)
        return None
    try:
        path = folder / f"nanoserve_cpu-{_build_key(compiler, isa)}.so"
        if not path.exists():
            _compile(compiler, isa, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("nanoserve's CPU kernels could not be built or loaded (%s); using torch", detail)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def _build_key(compiler: str, isa: tuple[str, ...]) -> str:
    """What names a build: a hash of the sources, the flags, the compiler's version and the CPU's
    features. Raises CalledProcessError when the compiler does not run."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in (*SOURCES, *HEADERS)), " ".join((*FLAGS, *isa)).encode(), version.encode(),
                 _cpu_features().encode()):
        key.update(part)
    return key.hexdigest()[:16]


def _compile(compiler: str, isa: tuple[str, ...], path: Path) -> None:
    """Builds the library under a temporary name beside `path` and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        log.info("compiling nanoserve's CPU kernels into %s (first use)", path)
        subprocess.run([compiler, *FLAGS, *isa, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                       check=True)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), else the platform's processor string: what -march=native
    compiled for."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()
