"""nanoserve's CPU kernel library: the C++ in `csrc/`, compiled at first use and loaded with ctypes.

The sources (`paged_attention.cpp`, `layer_ops.cpp`, `linear.cpp`, and `decoder.cpp`, which composes
the other three; headers `simd.h` and `kernels.h`) include no torch header and need no ninja: one
`g++ -O3 -march=native -fopenmp` call builds them in a few seconds.
OpenMP resolves to the libgomp that torch has already loaded (same soname). The library goes to
$NANOSERVE_CACHE/kernels under a name that hashes the sources, the flags, the compiler's version and
the CPU's feature flags (it is built for the CPU it runs on); it is written under a temporary name
and renamed into place, so a concurrent process sees either no file or a whole one.

Invariant: `load_cpu_kernels` returns a loaded library or None (with a warning saying why); it
never raises for a missing or failing compiler, so callers can fall back to torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanoserve.cache import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("paged_attention.cpp", "layer_ops.cpp", "linear.cpp", "decoder.cpp"))
HEADERS = (CSRC / "simd.h", CSRC / "kernels.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
# The element types the kernels are built for, and the suffix of each entry point's name.
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def load_cpu_kernels(cache_dir: Path | None = None) -> ctypes.CDLL | None:
    """The library, compiled first if this machine has no build of the current sources yet; None
    (with a warning) when it cannot be built or loaded."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s) found; nanoserve's CPU kernels are off", compiler)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256()
        for part in (*(p.read_bytes() for p in (*SOURCES, *HEADERS)), " ".join(FLAGS).encode(), version.encode(),
                     _cpu_features().encode()):
            key.update(part)
        path = (cache_dir or cache_root()) / "kernels" / f"nanoserve_cpu-{key.hexdigest()[:16]}.so"
        if not path.exists():
            _compile(compiler, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("nanoserve's CPU kernels could not be built or loaded (%s); using torch", detail)
        return None


def _compile(compiler: str, path: Path) -> None:
    """Builds the library under a temporary name beside `path` and renames it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        log.info("compiling nanoserve's CPU kernels into %s (first use)", path)
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, check=True)
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
