"""nanoserve's CPU kernel library: the C++ in `csrc/`, compiled when the package is installed (or,
failing that, at first use) and loaded with ctypes.

The sources (every file in `csrc/`: `paged_attention.cpp`, `layer_ops.cpp`, `linear.cpp`,
`quant.cpp` (products with GGUF block-quantized weights), `moe.cpp` (a mixture-of-experts
layer's routed feed-forward on block-quantized experts), `decoder.cpp`, which composes the others,
and their headers) include no torch header and need no ninja: one `g++ -O3 -fopenmp` call builds
them (`kernel_build`, which owns the sources, the flags and the build).

Which library loads: the package build (`setup.py`) compiles one library per x86-64 instruction set
level into `nanoserve/kernels/`, and `load_cpu_kernels` takes the best one this CPU runs, provided
it was built from the current sources. Otherwise (a source checkout edited since install, a CPU
below every level, an install without a compiler) it compiles the sources for this CPU
(`-march=native`) into $NANOSERVE_CACHE/kernels, under a name that hashes the sources, the flags,
the compiler's version and the CPU's feature flags, saying so in the log while it compiles. The
instruction set flags are a parameter, so that tests can build the same sources for an older CPU
(e.g. without VNNI) beside the native build.

`kernels.h` declares every entry point (each source includes it, so a definition that drifts from
its declaration fails to compile); `SIGNATURES` here gives each its ctypes result and argument
types, set on the library once when it is loaded, so callers take a function with `getattr(lib,
name)` (ctypes keeps that object on the library) and call it.

Invariants: `load_cpu_kernels` returns a loaded library or None (with a warning saying why); it
never raises for a missing or failing compiler, so callers can fall back to torch. It loads the
library once per process for each compiler, cache folder, instruction set and prebuilt folder (a
loaded shared library is global to the process anyway), and asks the compiler its version and
hashes the sources once per process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve import kernel_build
from nanoserve.cache import cache_root
from nanoserve.kernel_build import CSRC, FLAGS, NATIVE_ISA, PREBUILT

log = logging.getLogger(__name__)

__all__ = ["CSRC", "DTYPE_SUFFIX", "FLAGS", "NATIVE_ISA", "SIGNATURES", "load_cpu_kernels"]
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
                ("post_norm", ctypes.c_void_p), ("gate_up", Matrix), ("down", Matrix), ("rotary", ctypes.c_int64)]


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
    # moe.cpp
    "nanoserve_moe_ffn": Signature(_INT, (_PTR, _PTR, _INT, _PTR, _INT, _PTR, _INT, _PTR, _PTR, _PTR, _I64, _I64, _I64,
                                          _I64, _I64, _INT)),
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
    "nanoserve_quant_amx": Signature(_INT, ()),  # quant.cpp
}


def load_cpu_kernels(cache_dir: Path | None = None, isa: tuple[str, ...] | None = None,
                     prebuilt: Path | None = PREBUILT) -> ctypes.CDLL | None:
    """The library, its entry points declared as `SIGNATURES` says; None (with a warning) when it
    cannot be had. `isa` None: the best library in `prebuilt` (the package build's) for this CPU if
    it was built from the current sources, else one compiled for this CPU (`NATIVE_ISA`) in the
    cache folder (compiled first if this machine has no build of the current sources yet). `isa`
    given: a build for those instruction set flags (a CPU this one can run): the package build's
    variant with exactly those flags if it has one from the current sources, else compiled likewise.
    Cached: later calls with the same arguments and compiler ($CXX) return the same object."""
    return _load(os.environ.get("CXX", "g++"), (cache_dir or cache_root()) / "kernels", isa, prebuilt)


@functools.cache
def _load(compiler: str, folder: Path, isa: tuple[str, ...] | None, prebuilt: Path | None) -> ctypes.CDLL | None:
    lib = None
    if prebuilt is not None:
        found = (kernel_build.prebuilt_library(prebuilt) if isa is None
                 else kernel_build.prebuilt_variant(prebuilt, isa))
        if found.path is None:
            log.debug("%s; building the CPU kernels for this CPU", found.reason)
        else:
            try:
                lib = ctypes.CDLL(str(found.path))
            except OSError as exc:
                log.warning("the prebuilt CPU kernels %s did not load (%s); building them for this CPU", found.path,
                            exc)
    if lib is None:
        lib = _build_and_load(compiler, folder, isa or NATIVE_ISA)
    if lib is None:
        return None
    _declare(lib, every=True)
    return lib


def load_kernel_file(path: Path) -> ctypes.CDLL:
    """A kernel library file as it is (another tree's build, to time two builds side by side in one
    process), the entry points it shares with `SIGNATURES` declared as this tree declares them (the
    caller's to know that their signatures agree); no build, no cache. Raises OSError when it does
    not load."""
    lib = ctypes.CDLL(str(path))
    _declare(lib, every=False)
    return lib


def _declare(lib: ctypes.CDLL, every: bool) -> None:
    """lib's entry points typed as `SIGNATURES` says: every one of them (AttributeError for one it
    lacks), or (every False) those it has."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name) if every else getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes


def _build_and_load(compiler: str, folder: Path, isa: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library built for `isa` in `folder` (compiled first when missing), or None with a warning."""
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s) found and no prebuilt kernel library for these sources and this CPU; "
                    "nanoserve's CPU kernels are off (torch computes instead)", compiler)
        return None
    try:
        path = folder / f"nanoserve_cpu-{_build_key(compiler, isa)}.so"
        if not path.exists():
            log.info("compiling the CPU kernels (once, ~2-3 min on 2 cores) into %s ...", path)
            started = time.monotonic()
            kernel_build.compile_library(compiler, isa, path)
            log.info("compiled the CPU kernels in %.0f s", time.monotonic() - started)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("nanoserve's CPU kernels could not be built or loaded (%s); using torch", detail)
        return None


@functools.cache
def _build_key(compiler: str, isa: tuple[str, ...]) -> str:
    """What names an on-demand build: a hash of the sources and flags, the instruction set flags,
    the compiler's version and the CPU's features. Raises CalledProcessError when the compiler
    does not run."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    for part in (kernel_build.source_hash(), " ".join(isa), version, " ".join(sorted(kernel_build.cpu_flags()))):
        key.update(part.encode() + b"\0")
    return key.hexdigest()[:16]
