"""What a checkpoint declares about turning its hidden states into one embedding (`PoolingConfig`),
read from the files sentence-transformers writes beside the weights.

Declarations read: `modules.json` naming a `sentence_transformers.models.Pooling` module, whose
folder's `config.json` sets one `pooling_mode_*` flag (`pooling_mode_lasttoken`, as Qwen3-Embedding
declares, or `pooling_mode_mean_tokens`); without them pooling is the mean over the prompt. Whether
a vector may be cut to fewer `dimensions` (Matryoshka representation learning) is read from
`config.json` as vLLM reads it: `is_matryoshka: true` (any size up to the hidden size) or a list of
`matryoshka_dimensions` (only those sizes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_POOLING_MODULE = "sentence_transformers.models.Pooling"


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How a model's embeddings are made. Invariants: `method` is "mean" or "last" (`SamplingParams`'
    `POOLING_METHODS`);
    `matryoshka_dimensions`, when set, lists sizes in [1, hidden_size] (and implies `matryoshka`)."""

    method: str
    hidden_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int) -> None:
        """Raises ValueError unless the model's vectors may be cut to `dimensions` values."""
        if not self.matryoshka:
            raise ValueError("this model does not support `dimensions` (it declares no Matryoshka embeddings)")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")


def read_pooling_config(source: Path, hidden_size: int) -> PoolingConfig:
    """The pooling a checkpoint declares: `source` is its folder (a GGUF file declares none: mean,
    no Matryoshka). Raises ValueError for a declared pooling mode nanoserve does not run."""
    if not source.is_dir():
        return PoolingConfig("mean", hidden_size)
    method = "mean"
    modules_file = source / "modules.json"
    for module in json.loads(modules_file.read_text()) if modules_file.is_file() else []:
        if module.get("type") != _POOLING_MODULE:
            continue
        config_file = source / module.get("path", "") / "config.json"
        modes = json.loads(config_file.read_text()) if config_file.is_file() else {}
        chosen = sorted(k for k, v in modes.items() if k.startswith("pooling_mode_") and v is True)
        if len(chosen) > 1 or any(k not in _MODES for k in chosen):
            raise ValueError(f"{config_file}: nanoserve pools by one of {', '.join(_MODES)}; "
                             f"the checkpoint declares {', '.join(chosen)}")
        if chosen:
            method = _MODES[chosen[0]]
    config_json = source / "config.json"
    hf_config: dict[str, Any] = json.loads(config_json.read_text()) if config_json.is_file() else {}
    dims = hf_config.get("matryoshka_dimensions")
    return PoolingConfig(method, hidden_size, matryoshka=bool(hf_config.get("is_matryoshka")) or bool(dims),
                         matryoshka_dimensions=None if not dims else tuple(int(d) for d in dims))
