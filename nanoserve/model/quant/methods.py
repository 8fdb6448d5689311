"""The `--quantization` methods: the block format a dense checkpoint's layer matrices are quantized
to at load (None: kept as the checkpoint holds them). "dense" is the reference mode: every matrix
dense in the model's dtype, a GGUF file's blocks dequantized at load, so no product quantizes its
activations (the loader applies it: `nanoserve.model.checkpoint.loader.load_model`). A module of
its own, free of torch, so the CLI's parser can offer the names.

No int4 (q4_0): its one-row product is slower than q8_0's and no faster at 16 rows (half the bytes,
but more work per value to unpack; the figures are in docs/benchmarks-history.md, "Figures once
quoted in code and in docs/architecture.md")."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

QUANTIZATION_METHODS: Mapping[str, str | None] = MappingProxyType({"none": None, "int8": "q8_0", "dense": None})
