"""Where nanoserve keeps what it builds on first use (demo checkpoints, model-shape checkpoints,
GGUF exports, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$NANOSERVE_CACHE, else ~/.cache/nanoserve (not created here)."""
    return Path(os.environ.get("NANOSERVE_CACHE") or Path.home() / ".cache" / "nanoserve")
