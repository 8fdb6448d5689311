"""The house's layers (docs/architecture.md, "Layers"): every import inside `nanoserve/`, read file by
file from the source (function-level and TYPE_CHECKING imports included), goes to the importer's own
layer or one below it, and no set of modules imports itself in a circle.

A package's face (`__init__.py`) may re-export anything inside its own package (the top one,
`nanoserve/__init__.py`, anything at all); every other import is held to the order below.
Packages that share a layer (`server` and `supervisor`, the leaves at the bottom) import nothing
of each other.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import nanoserve

ROOT = Path(nanoserve.__file__).parent

# Top to bottom. A module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("nanoserve.cli", "nanoserve.commands"),
    ("nanoserve.bench",),
    ("nanoserve.server", "nanoserve.supervisor"),
    ("nanoserve.server.chat", "nanoserve.server.web"),
    ("nanoserve.server.protocol",),
    ("nanoserve.runtime",),
    ("nanoserve.parallel",),
    ("nanoserve.engine",),
    ("nanoserve.model.checkpoint",),
    ("nanoserve.model.demo",),
    ("nanoserve.model",),
    ("nanoserve.model.layers",),
    ("nanoserve.model.quant",),
    ("nanoserve.model.config",),
    ("nanoserve.model.families",),
    ("nanoserve.attention",),
    ("nanoserve.native",),
    ("nanoserve.kv", "nanoserve.tokenizer", "nanoserve.cache", "nanoserve.log", "nanoserve.settings",
     "nanoserve.kernel_build"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The nanoserve modules `path` imports anywhere in its body. `from a.b import c` is module a.b.c
    where that is a module, else a.b."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "nanoserve")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nanoserve":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def layer_key(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it); raises for a module that no layer names."""
    best: tuple[int, str] | None = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    if best is None:
        raise LookupError(f"{module} is in no layer: add it to LAYERS and to docs/architecture.md")
    return best


def violations(graph: dict[str, set[str]], faces: set[str]) -> list[str]:
    """Each import that runs up a layer, or sideways between packages of one layer."""
    found = []
    for importer, targets in sorted(graph.items()):
        if importer == "nanoserve":
            continue
        layer, prefix = layer_key(importer)
        for target in sorted(targets):
            if importer in faces and target.startswith(importer + "."):
                continue  # a package's face re-exports its own modules
            target_layer, target_prefix = layer_key(target)
            if target_layer < layer:
                found.append(f"{importer} -> {target}: up from {prefix} to {target_prefix}")
            elif target_layer == layer and target_prefix != prefix:
                found.append(f"{importer} -> {target}: sideways from {prefix} to {target_prefix}")
    return found


def import_graph() -> tuple[dict[str, set[str]], set[str]]:
    mods = modules()
    known = set(mods)
    graph = {name: imports_of(path, known) - {name} for name, path in mods.items()}
    faces = {name for name, path in mods.items() if path.name == "__init__.py"}
    return graph, faces


def test_every_import_goes_down_the_layers() -> None:
    graph, faces = import_graph()
    assert violations(graph, faces) == []


def test_no_import_circle() -> None:
    graph, faces = import_graph()
    # A face's re-exports are how a package is used, not a dependency of its members on each other.
    edges = {m: {t for t in ts if not (m in faces and t.startswith(m + "."))} for m, ts in graph.items()}
    graphlib.TopologicalSorter(edges).prepare()  # raises CycleError naming the circle


def test_the_checks_catch_what_they_forbid() -> None:
    """The checker itself: an engine module importing the runtime, the supervisor importing the
    server, and a two-module circle are each caught."""
    graph = {"nanoserve.engine.llm_engine": {"nanoserve.runtime.builder", "nanoserve.kv.manager"},
             "nanoserve.supervisor.router": {"nanoserve.server.app"},
             "nanoserve.model": {"nanoserve.model.checkpoint.loader"}}
    assert violations(graph, faces={"nanoserve.model"}) == [
        "nanoserve.engine.llm_engine -> nanoserve.runtime.builder: up from nanoserve.engine to nanoserve.runtime",
        "nanoserve.supervisor.router -> nanoserve.server.app: sideways from nanoserve.supervisor to nanoserve.server",
    ]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"a"}}).prepare()
    with pytest.raises(LookupError, match="in no layer"):
        layer_key("nanoserve.newpackage.mod")
