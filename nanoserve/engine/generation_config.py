"""A model's sampling defaults, from its `generation_config.json`, as vLLM applies them.

`sampling_defaults` picks the fields a request may leave unset (temperature, top_p, top_k, min_p,
repetition_penalty) out of the model's generation config; the offline API builds its default
`SamplingParams` from them and the server fills every field a request leaves out (or sends as
null) with them. `--generation-config vllm` ignores the file: the defaults are then SamplingParams'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field, with the type the field takes.
_FIELDS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
}

MODES = ("auto", "vllm")


def sampling_defaults(mode: str, model_config: Mapping[str, Any]) -> dict[str, float | int]:
    """The sampling fields `mode` sets: from `model_config` (the checkpoint's generation config)
    with "auto", none with "vllm", or from the generation_config.json of the folder `mode` names.
    A value of the wrong type is skipped."""
    if mode == "vllm":
        return {}
    if mode != "auto":
        path = Path(mode) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config: {path} does not exist (give auto, vllm or a folder)")
        model_config = json.loads(path.read_text())
    defaults: dict[str, float | int] = {}
    for key, (name, kind) in _FIELDS.items():
        value = model_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind is int and not float(value).is_integer():
            continue
        defaults[name] = kind(value)
    return defaults
