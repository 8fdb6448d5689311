"""The CPU kernel library's builds the kernel tests run on (no tests here): the native build, and
where the CPU has VNNI, the builds for older instruction sets: the package build's AVX2 variant
(prebuilt at install, else compiled) and a plain x86-64 build (the scalar path, compiled once into
the on-disk cache). A build this CPU cannot tell apart from the native one is skipped, saying why."""

from __future__ import annotations

import ctypes
import shutil
from typing import Any

import pytest

from nanoserve.kernel_build import X86_VARIANTS, cpu_flags
from nanoserve.native import load_cpu_kernels

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")
AVX2_ISA = next(v.isa for v in X86_VARIANTS if v.name == "avx2")
# Each build's instruction set flags (None: the library nanoserve loads, prebuilt for this CPU or
# compiled with -march=native).
BUILDS: dict[str, tuple[str, ...] | None] = {"native": None, "no-vnni": AVX2_ISA, "no-avx2": ("-march=x86-64",)}
# pytest params of a fixture over BUILDS: the native build in the fast tier, the older ones slow.
BUILD_PARAMS: list[Any] = [
    pytest.param(name, marks=[needs_compiler] if name == "native" else [needs_compiler, pytest.mark.slow])
    for name in BUILDS]


def load_build(name: str) -> ctypes.CDLL:
    """The library of build `name` (a key of BUILDS), skipping the test where this CPU's native build
    is that path already (no VNNI; no AVX2)."""
    flags = cpu_flags()
    if name != "native" and not flags & {"avx512_vnni", "avx_vnni"}:
        pytest.skip("this CPU has no VNNI: the native build is the AVX2 or scalar path already")
    if name == "no-avx2" and "avx2" not in flags:
        pytest.skip("this CPU has no AVX2: the native build is the scalar path already")
    lib = load_cpu_kernels(isa=BUILDS[name])
    assert lib is not None, f"g++ is installed, so the library must build ({name})"
    return lib
