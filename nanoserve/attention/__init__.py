"""Attention backends behind one interface (see `metadata.AttentionBackend`)."""

import os

import torch

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.attention.torch_ref import TorchAttention
from nanoserve.attention.triton_backend import TritonAttention

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "TorchAttention", "TritonAttention",
           "select_backend"]

BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' is triton on CUDA devices and torch elsewhere; 'torch' and 'triton' force one.
    Raises ValueError for an unknown name or for triton off CUDA (unless TRITON_INTERPRET=1 runs its
    kernels on the CPU), ImportError for triton without the package."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton attention backend runs on CUDA devices, not {device.type}; use torch")
    return TritonAttention() if name == "triton" else TorchAttention()
