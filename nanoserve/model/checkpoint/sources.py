"""What a model argument names, decided without loading anything (and without torch), so that
`nanoserve serve` can refuse a missing or unreadable model before it starts the engine.

A model argument is: None (the demo model); a local folder or .gguf file (it exists); a name of
the registry catalogue (`registry_models.CATALOGUE`, fetched on first use); otherwise a hub id
(`owner/name`). Anything else that looks like a path is a missing file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from nanoserve.model.checkpoint import registry_models
from nanoserve.model.config import ModelLoadError

SourceKind = Literal["demo", "local", "registry", "hub"]


def source_kind(source: str | Path | None) -> SourceKind:
    """The kind of model `source` names; ModelLoadError for a local path that does not exist or
    that this process may not read."""
    if source is None:
        return "demo"
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
            raise ModelLoadError(f"model {text!r} is not readable (permission denied)")
        return "local"
    if text in registry_models.CATALOGUE:
        return "registry"
    if text.endswith(".gguf") or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise ModelLoadError(f"model {text!r} not found: no such file or folder")
    return "hub"
