"""Attention backends behind one interface (see `metadata.AttentionBackend`).

`BACKEND_NAMES` and `select_backend` import no backend (nor torch) until a backend is chosen, so the
CLI's parser can offer the names; the backend classes are imported on first use (PEP 562)."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nanoserve.attention.cpu_paged import CpuPagedAttention
    from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
    from nanoserve.attention.torch_ref import TorchAttention
    from nanoserve.attention.triton_backend import TritonAttention

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "TorchAttention",
           "TritonAttention", "select_backend"]

BACKEND_NAMES = ("auto", "cpu", "torch", "triton")

_EXPORTS = {"CpuPagedAttention": "cpu_paged", "AttentionBackend": "metadata",
            "AttentionMetadata": "metadata", "TorchAttention": "torch_ref", "TritonAttention": "triton_backend"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' is triton on CUDA devices, elsewhere the C++ kernel of 'cpu' where it builds and torch
    where it does not; 'cpu', 'torch' and 'triton' force one. Raises ValueError for an unknown name,
    for triton off CUDA (unless TRITON_INTERPRET=1 runs its kernels on the CPU), for cpu on another
    device or without a working C++ compiler; ImportError for triton without the package."""
    from nanoserve.attention.cpu_paged import CpuPagedAttention, load_paged_attention
    from nanoserve.attention.torch_ref import TorchAttention
    from nanoserve.attention.triton_backend import TritonAttention

    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton attention backend runs on CUDA devices, not {device.type}; use torch")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        return TritonAttention()
    if name == "torch":
        return TorchAttention()
    if device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on the CPU, not {device.type}")
    kernel = load_paged_attention()
    if kernel is not None:
        return CpuPagedAttention(kernel)
    if name == "cpu":
        raise ValueError("the cpu attention backend needs a working C++ compiler (g++ or $CXX); use torch")
    return TorchAttention()
