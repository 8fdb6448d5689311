"""The KV pool's memory: one zero-filled tensor, allocated so that its size costs nothing up front.

`torch.zeros` writes every byte of a pool when it is made (gigabytes at the default size: seconds
of a server's startup). On the CPU the pool is instead a view of a fresh private anonymous memory
map, whose pages the kernel hands out zero-filled on first touch, so only the blocks a workload
uses are ever paid for. Elsewhere (CUDA) it is `torch.zeros`, a device memset.

Invariant: every element of a new pool reads as zero (padded block-table reads are masked, and a
zero never turns into NaN); the tensor keeps its memory map alive for as long as it lives.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of `shape` and `dtype` on `device`, every element zero."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # frombuffer holds a reference to the map
