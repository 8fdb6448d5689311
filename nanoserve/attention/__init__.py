"""Attention backends behind one interface (see `metadata.AttentionBackend`)."""

from nanoserve.attention.metadata import AttentionBackend, AttentionMetadata
from nanoserve.attention.torch_ref import TorchAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention"]
