"""The CPU kernels built when the package is installed (setup.py, nanoserve/kernel_build.py) and
which library `native.load_cpu_kernels` then loads: the best prebuilt variant this CPU runs when it
was built from the current sources, else the on-demand build, and never a stale one."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve import kernel_build, native

REPO = Path(__file__).resolve().parents[1]


def _manifest(folder: Path, variants: list[tuple[str, list[str]]], digest: str | None = None) -> None:
    """The manifest of a prebuilt folder whose libraries are `variants` (name, CPU flags), best first,
    built from the sources whose hash is `digest` (by default the current ones)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = [{"name": name, "file": f"nanoserve_cpu-{name}.so", "cpu_flags": flags} for name, flags in variants]
    (folder / kernel_build.MANIFEST).write_text(json.dumps({"source_hash": digest or kernel_build.source_hash(),
                                                            "variants": entries}))


def test_the_best_variant_the_cpu_runs(tmp_path: Path) -> None:
    _manifest(tmp_path, [("amx", ["avx2", "amx_tile"]), ("avx512", ["avx2", "avx512_vnni"]), ("avx2", ["avx2"])])
    for name in ("amx", "avx512", "avx2"):
        (tmp_path / f"nanoserve_cpu-{name}.so").touch()
    pick = kernel_build.prebuilt_library
    assert pick(tmp_path, frozenset({"avx2", "avx512_vnni", "amx_tile"})).path == tmp_path / "nanoserve_cpu-amx.so"
    assert pick(tmp_path, frozenset({"avx2", "avx512_vnni"})).path == tmp_path / "nanoserve_cpu-avx512.so"
    assert pick(tmp_path, frozenset({"avx2", "sse4_2"})).path == tmp_path / "nanoserve_cpu-avx2.so"
    assert pick(tmp_path, frozenset({"sse4_2"})) == (None, "no prebuilt kernel library fits this CPU")
    (tmp_path / "nanoserve_cpu-amx.so").unlink()  # a variant whose file is gone is skipped
    assert pick(tmp_path, frozenset({"avx2", "avx512_vnni", "amx_tile"})).path == tmp_path / "nanoserve_cpu-avx512.so"


def test_a_stale_or_missing_build_is_never_picked(tmp_path: Path) -> None:
    assert kernel_build.prebuilt_library(tmp_path).path is None  # no manifest
    _manifest(tmp_path, [("avx2", [])], digest="0" * 16)
    (tmp_path / "nanoserve_cpu-avx2.so").touch()
    assert kernel_build.prebuilt_library(tmp_path) == (None, "the prebuilt kernels are older than the sources in csrc/")


def test_a_build_for_given_flags_is_the_variant_built_with_them(tmp_path: Path) -> None:
    """`load_cpu_kernels(isa=...)` (the tests' builds for older instruction sets) takes the prebuilt
    variant compiled with exactly those flags, when current, instead of compiling again."""
    avx2 = next(v for v in kernel_build.X86_VARIANTS if v.name == "avx2")
    _manifest(tmp_path, [(v.name, sorted(v.cpu_flags)) for v in kernel_build.X86_VARIANTS])
    for v in kernel_build.X86_VARIANTS:
        (tmp_path / f"nanoserve_cpu-{v.name}.so").touch()
    assert kernel_build.prebuilt_variant(tmp_path, avx2.isa).path == tmp_path / "nanoserve_cpu-avx2.so"
    assert kernel_build.prebuilt_variant(tmp_path, ("-march=x86-64",)) == (
        None, "no prebuilt kernel library built with -march=x86-64")
    _manifest(tmp_path, [("avx2", sorted(avx2.cpu_flags))], digest="0" * 16)
    assert kernel_build.prebuilt_variant(tmp_path, avx2.isa) == (
        None, "the prebuilt kernels are older than the sources in csrc/")


def test_the_source_hash_covers_every_file_in_csrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source another change adds to csrc/ is compiled and hashed without being listed anywhere."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    monkeypatch.setattr(kernel_build, "CSRC", csrc)
    before = kernel_build.source_hash()
    assert before == kernel_build.source_hash()
    (csrc / "new_kernel.cpp").write_text("// a new translation unit\n")
    assert csrc / "new_kernel.cpp" in kernel_build.sources()
    after = kernel_build.source_hash()
    (csrc / "simd.h").write_text((csrc / "simd.h").read_text() + "\n")
    assert len({before, after, kernel_build.source_hash()}) == 3


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")
def test_a_current_prebuilt_library_loads_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """With a prebuilt library of the current sources, nothing is compiled (no compiler is even
    looked for); with a stale one, the on-demand build runs, and without a compiler the kernels are
    off, saying why."""
    lib = native.load_cpu_kernels()  # whichever this checkout has; its file stands in for a prebuilt variant
    assert lib is not None
    prebuilt = tmp_path / "prebuilt"
    _manifest(prebuilt, [("any", [])])
    shutil.copy(lib._name, prebuilt / "nanoserve_cpu-any.so")
    monkeypatch.setattr(native.shutil, "which", lambda _: None)  # no compiler on this machine
    loaded = native.load_cpu_kernels(tmp_path / "cache", prebuilt=prebuilt)
    assert loaded is not None and loaded._name == str(prebuilt / "nanoserve_cpu-any.so")
    assert loaded.nanoserve_quant_isa() == lib.nanoserve_quant_isa()  # declared: a ctypes function with its types
    assert not (tmp_path / "cache").exists()

    _manifest(prebuilt, [("any", [])], digest="0" * 16)  # the sources changed after the build
    with caplog.at_level(logging.WARNING, logger="nanoserve.native"):
        assert native.load_cpu_kernels(tmp_path / "cache2", prebuilt=prebuilt) is None
    assert "no C++ compiler (g++) found" in caplog.text and "torch computes instead" in caplog.text


def test_an_install_without_a_compiler_goes_on_and_says_so(tmp_path: Path) -> None:
    """setup.py's build step, on a machine whose compiler is missing: it succeeds, names the
    problem, and builds nothing."""
    env = {**os.environ, "CXX": "no-such-compiler-here"}
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_kernels", "--build-lib", str(tmp_path)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "no C++ compiler (no-such-compiler-here) found: the CPU kernels are NOT built" in run.stderr
    assert not (tmp_path / "nanoserve").exists()


def test_another_build_loads_as_it_is_beside_this_one(tmp_path: Path) -> None:
    """`load_kernel_file` (two builds side by side in one process, `scripts/bench_products.py
    --against`): a copy of this tree's library loads as a second library, its entry points declared
    as this tree declares them and answering as this tree's do, with nothing built or cached; a
    file that is not a library raises OSError."""
    lib = native.load_cpu_kernels()
    assert lib is not None
    copy = tmp_path / "other.so"
    shutil.copy(lib._name, copy)
    other = native.load_kernel_file(copy)
    assert other._name == str(copy)
    assert other.nanoserve_quant_isa() == lib.nanoserve_quant_isa()
    assert other.nanoserve_quant_isa.argtypes == lib.nanoserve_quant_isa.argtypes
    assert other.nanoserve_quant_linear_f32.restype is lib.nanoserve_quant_linear_f32.restype
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.so"]
    (tmp_path / "not-a-library.so").write_text("no")
    with pytest.raises(OSError):
        native.load_kernel_file(tmp_path / "not-a-library.so")
