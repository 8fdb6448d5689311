"""llama-server, llama.cpp's HTTP server with parallel slots: found or built once, and its command line.

The binary is built from the llama.cpp source vendored in the llama-cpp-python sdist of
`LLAMA_CPP_PYTHON_VERSION` (the version whose library `bench quant` and the peers use), so that
both peers run the same llama.cpp: `pip download --no-deps --no-binary :all:` of the sdist into
`$NANOSERVE_CACHE/llama-server/`, extracted there, configured with cmake (Release, `GGML_NATIVE`,
no curl, shared libraries) into `llama-server/build` and only the `llama-server` target built.
A build directory that already holds the binary is reused as it is.

On CPUs with AMX-INT8 llama.cpp's repacked AMX product crashes on quantized files ("Illegal
instruction"; llama.cpp #20824), so `server_command` passes `--no-repack` there.

Invariant: `llama_server_binary` returns a path that exists and is executable, or raises
`LlamaServerUnavailable` saying which step failed; it never leaves a half-extracted source behind
under the final name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from nanoserve.cache import cache_root

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


class LlamaServerUnavailable(RuntimeError):
    """llama-server is not built and could not be built (no cmake, no compiler, no registry)."""


def llama_server_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or cache_root()) / "llama-server"


def built_binary(cache_dir: Path | None = None) -> Path | None:
    """The cached llama-server binary, if it has been built."""
    path = llama_server_dir(cache_dir) / "build" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _run(cmd: list[str], step: str, timeout_s: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaServerUnavailable(f"building llama-server: {step} failed: {e}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise LlamaServerUnavailable(f"building llama-server: {step} failed (exit {done.returncode}):\n{tail}")


def _source(root: Path) -> Path:
    """The vendored llama.cpp source of the sdist, downloaded and extracted on first use."""
    src = root / _SDIST / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    archive = root / f"{_SDIST}.tar.gz"
    if not archive.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
              "--disable-pip-version-check", "-d", str(root), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
             "pip download of the llama-cpp-python sdist", 900)
    with tempfile.TemporaryDirectory(dir=root, prefix=".extract-") as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        shutil.rmtree(root / _SDIST, ignore_errors=True)
        os.replace(Path(tmp) / _SDIST, root / _SDIST)
    return src


def llama_server_binary(cache_dir: Path | None = None, jobs: int | None = None) -> Path:
    """The llama-server binary: the cached build, else built now (several minutes on 2 cores)."""
    found = built_binary(cache_dir)
    if found is not None:
        return found
    if shutil.which("cmake") is None:
        raise LlamaServerUnavailable("building llama-server needs cmake (and a C++ compiler) on PATH")
    root = llama_server_dir(cache_dir)
    src, build = _source(root), root / "build"
    _run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
          "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF"], "cmake configure", 900)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)],
         "cmake --build --target llama-server", 3600)
    found = built_binary(cache_dir)
    if found is None:
        raise LlamaServerUnavailable(f"the build finished but {build / 'bin' / 'llama-server'} is missing")
    return found


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX-INT8 (where llama.cpp's repacked path crashes)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "amx_int8" in line.split() for line in text.splitlines())


def server_command(binary: Path, gguf: Path, port: int, slots: int, slot_context: int, threads: int,
                   no_repack: bool) -> list[str]:
    """llama-server serving `gguf` on 127.0.0.1:`port` with `slots` parallel slots of
    `slot_context` tokens each (`-c` is the whole context, shared by the slots), `threads`
    threads for decoding and prompts alike."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(slots * slot_context), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    return [*cmd, "--no-repack"] if no_repack else cmd
