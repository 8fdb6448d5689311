"""How nanoserve's CPU kernel library is built: its sources (every file in `csrc/`), the compiler
flags, the instruction-set variants compiled when the package is installed, and the one compile
command that the package build (`setup.py`) and the on-demand build (`native.py`) both run.

Standard library only: `setup.py` loads this file by its path, before nanoserve (or torch) can be
imported. The sources include no torch header; OpenMP resolves at run time to the libgomp that
torch has already loaded (same soname).

Variants. Each kernel chooses its path when it is compiled (AVX2; AVX512 with VNNI and BF16), so on
x86-64 the package build compiles one library per instruction-set level (`X86_VARIANTS`) and
`native.py` loads, at run time, the first one whose CPU flags this CPU has. The one choice made at
run time: the AVX512 variant is also compiled with AMX-INT8, which the k-quant products of many
rows take where the CPU has it and the OS grants it (quant_amx.h; the same bits as without). On any
other machine it compiles one library for the CPU it runs on (`-march=native`), which needs that
CPU's flags at run time. A CPU below every variant (no AVX2) gets the on-demand native build.

Invariants: a prebuilt folder holds the libraries and a `manifest.json` naming the hash of the
sources and flags they were built from (`source_hash`) and, best first, each variant's file and
required CPU flags; `prebuilt_library` returns a library only when that hash equals the current
sources' hash, so a source checkout edited after install is never served a stale build.
`compile_library` writes under a temporary name and renames into place, so a concurrent reader
sees either no file or a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

CSRC = Path(__file__).with_name("csrc")
PREBUILT = Path(__file__).with_name("kernels")  # where the package build puts its libraries
MANIFEST = "manifest.json"
FLAGS = ("-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
NATIVE_ISA = ("-march=native",)  # the instruction set flags of a build for this CPU


class Variant(NamedTuple):
    """One prebuilt library: its name, its instruction set flags, and the /proc/cpuinfo flags a
    CPU needs to run it."""

    name: str
    isa: tuple[str, ...]
    cpu_flags: frozenset[str]


_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})  # x86-64-v3
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
_AVX512 = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-int8")
# Best first: the first whose flags a CPU has is the one it runs.
X86_VARIANTS = (
    Variant("avx512", _AVX512, _V4 | {"avx512_vnni", "avx512_bf16"}),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
)


def sources() -> tuple[Path, ...]:
    """The translation units: every .cpp in csrc/, in name order (one library of all of them)."""
    return tuple(sorted(CSRC.glob("*.cpp")))


def source_hash() -> str:
    """A hash of every file in csrc/ (name and bytes) and of FLAGS: what a prebuilt build must match."""
    key = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    return key.hexdigest()[:16]


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(next((line for line in f if line.startswith(("flags", "Features"))), ":").split(":", 1)[1]
                             .split())
    except OSError:
        return frozenset()


def build_variants() -> tuple[Variant, ...]:
    """What the package build compiles on this machine: the x86-64 levels, or one native build."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return X86_VARIANTS
    return (Variant("native", NATIVE_ISA, cpu_flags()),)


def compile_library(compiler: str, isa: tuple[str, ...], path: Path) -> None:
    """Compiles every source into the shared library `path` (under a temporary name beside it,
    renamed into place). Raises CalledProcessError (with the compiler's output) if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *isa, *map(str, sources()), "-o", tmp], capture_output=True, text=True,
                       check=True)
        os.chmod(tmp, 0o755)  # mkstemp's file is private; a library is for every user of the install
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def build_prebuilt(compiler: str, folder: Path, jobs: int) -> tuple[list[str], dict[str, str]]:
    """Compiles every variant of `build_variants` into `folder` (`jobs` compilers at a time) and
    writes the manifest of those that built. Returns (the names built, the error of each that did
    not: e.g. a compiler too old for a variant's flags)."""
    variants = build_variants()
    digest = source_hash()

    def build(v: Variant) -> str | None:
        try:
            compile_library(compiler, v.isa, folder / f"nanoserve_cpu-{v.name}.so")
        except subprocess.CalledProcessError as e:
            lines = (e.stderr or "").strip().splitlines()
            return lines[-1] if lines else str(e)
        return None

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        errors = dict(zip((v.name for v in variants), pool.map(build, variants), strict=True))
    built = [v for v in variants if errors[v.name] is None]
    manifest = {"source_hash": digest, "variants": [
        {"name": v.name, "file": f"nanoserve_cpu-{v.name}.so", "cpu_flags": sorted(v.cpu_flags)} for v in built]}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return [v.name for v in built], {name: err for name, err in errors.items() if err is not None}


class Prebuilt(NamedTuple):
    """What `prebuilt_library` found: the library to load (None if none fits), and why not."""

    path: Path | None
    reason: str


def prebuilt_library(folder: Path, flags: frozenset[str] | None = None) -> Prebuilt:
    """The best prebuilt library in `folder` for a CPU with `flags` (this one's by default), if
    the folder's manifest was built from the current sources."""
    variants, reason = _current_variants(folder)
    have = cpu_flags() if flags is None else flags
    for v in variants:
        if set(v["cpu_flags"]) <= have and (folder / v["file"]).exists():
            return Prebuilt(folder / v["file"], f"prebuilt for {v['name']}")
    return Prebuilt(None, reason or "no prebuilt kernel library fits this CPU")


def prebuilt_variant(folder: Path, isa: tuple[str, ...]) -> Prebuilt:
    """The prebuilt library in `folder` compiled with exactly the instruction set flags `isa` (a
    variant of `build_variants`), if the folder's manifest was built from the current sources."""
    variants, reason = _current_variants(folder)
    names = {v.name for v in build_variants() if v.isa == isa}
    for v in variants:
        if v["name"] in names and (folder / v["file"]).exists():
            return Prebuilt(folder / v["file"], f"prebuilt for {v['name']}")
    return Prebuilt(None, reason or f"no prebuilt kernel library built with {' '.join(isa)}")


def _current_variants(folder: Path) -> tuple[list[dict[str, Any]], str]:
    """The variants the manifest in `folder` lists, if it was built from the current sources; else
    none, and why."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [], f"no prebuilt kernels in {folder}"
    if manifest.get("source_hash") != source_hash():
        return [], "the prebuilt kernels are older than the sources in csrc/"
    return list(manifest.get("variants", [])), ""
