"""The KV pool's memory (engine/kv_memory.py): zero everywhere, writable, alive as long as the
tensor, and on the CPU not paid for until touched."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from nanoserve.engine.kv_memory import zeroed_pool


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_writable_and_alive_as_long_as_the_tensor(dtype: torch.dtype) -> None:
    pool = zeroed_pool((2, 2, 5, 16, 3, 8), dtype, torch.device("cpu"))
    assert pool.shape == (2, 2, 5, 16, 3, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    view = pool[1, 0, 4]
    del pool
    gc.collect()
    view.fill_(2.0)  # the map outlives the name it was made under
    assert view.sum().item() == 2.0 * view.numel()
    assert not zeroed_pool((0, 4), dtype, torch.device("cpu")).numel()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc (Linux)")
def test_a_cpu_pool_costs_no_memory_until_touched() -> None:
    before = _resident_bytes()
    pool = zeroed_pool((1024, 1024, 256), torch.float32, torch.device("cpu"))  # 1 GiB
    assert _resident_bytes() - before < 64 << 20
    pool[:16].fill_(1.0)  # 16 MiB touched
    assert 16 << 20 <= _resident_bytes() - before < 96 << 20
