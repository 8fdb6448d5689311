"""The package build's one step beyond pyproject.toml: nanoserve's CPU kernels.

`build_kernels` runs inside setuptools' `build` (so in `pip install .`, `pip install -e .` and
`python -m build` alike). It compiles the sources in nanoserve/csrc/ with `nanoserve/kernel_build.py`
(the module the on-demand build at run time uses too: the same sources, the same flags), one
library per x86-64 instruction set level, into `nanoserve/kernels/` of the wheel, or of the source
tree for an editable install; at run time nanoserve loads the best one the CPU has. It needs a C++
compiler and OpenMP, not torch. Without a compiler the install goes on, saying so; nanoserve then
computes with torch (or compiles at first use once a compiler is there).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def kernel_build() -> ModuleType:
    """nanoserve/kernel_build.py, loaded by its path (nanoserve itself is not importable here)."""
    spec = importlib.util.spec_from_file_location("_nanoserve_kernel_build", HERE / "nanoserve" / "kernel_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say(message: str) -> None:
    """A line on the build's stderr (pip shows it with -v, or when the build fails)."""
    print(f"nanoserve build: {message}", file=sys.stderr, flush=True)


class BuildKernels(Command):
    """Compiles the CPU kernel libraries and their manifest (see the module's docstring)."""

    description = "compile nanoserve's C++ CPU kernels"
    user_options: ClassVar[list[tuple[str, str | None, str]]] = [("build-lib=", "d", "where to build")]

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self.outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        kb = kernel_build()
        folder = kb.PREBUILT if self.editable_mode else Path(self.build_lib or "build") / "nanoserve" / "kernels"
        compiler = os.environ.get("CXX", "g++")
        if shutil.which(compiler) is None:
            say(f"no C++ compiler ({compiler}) found: the CPU kernels are NOT built, and nanoserve will compute "
                "with torch (slower). Install g++ (e.g. apt-get install g++) and reinstall to build them.")
            return
        started = time.monotonic()
        say(f"compiling the CPU kernels with {compiler} into {folder} (a few minutes) ...")
        built, errors = kb.build_prebuilt(compiler, folder, os.cpu_count() or 1)
        for name, error in errors.items():
            say(f"the {name} kernels did not compile ({error}); CPUs that need them get the next level down")
        say(f"compiled {', '.join(built) or 'nothing'} in {time.monotonic() - started:.0f} s")
        self.outputs = [str(folder / kb.MANIFEST), *(str(folder / f"nanoserve_cpu-{name}.so") for name in built)]

    def get_outputs(self) -> list[str]:
        return [] if self.editable_mode else self.outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}


class BinaryDistribution(Distribution):
    """A distribution with compiled code: its wheel is tagged for this platform, not pure Python."""

    def has_ext_modules(self) -> bool:
        return True


build.sub_commands = [*build.sub_commands, ("build_kernels", None)]
setup(cmdclass={"build_kernels": BuildKernels}, distclass=BinaryDistribution)
