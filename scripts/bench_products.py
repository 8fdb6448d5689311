"""The quantized products alone: real tensors of a GGUF file times random activations, GMAC/s.

Usage: python scripts/bench_products.py FILE.gguf [--tensors blk.0.ffn_gate.weight,blk.0.ffn_down.weight]
       [--rows 1,16,32,64,512,2048] [--threads 1,2] [--rounds 3]

For each tensor, row count and thread count: `CpuLayerOps.linear` of bf16 x [rows, in] against the
tensor as the file stores it (kept quantized), through the kernel library this tree loads (no
Python per call beyond the op's own). Prints the best of --rounds in GMAC/s and a digest of the
output's bytes: run it from two trees (PYTHONPATH, from a folder outside both) to compare kernels,
the digests saying whether both computed the same bits. The CPU, its kernel-relevant flags, the
path the products take (`nanoserve_quant_isa`, and whether the k-quants' many-row products take AMX
tiles) and the load average are printed first.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np
import torch
from gguf import GGUFReader

from nanoserve.bench.quant import machine_info
from nanoserve.model.checkpoint.gguf_reader import KEPT_TYPES
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.quant.block_quant import BlockQuantWeight
from nanoserve.native import load_cpu_kernels


def best_seconds(ops: CpuLayerOps, x: torch.Tensor, w: BlockQuantWeight, rounds: int) -> tuple[float, str]:
    """Best of `rounds` wall times of one product (each round repeated to ~0.2 s), and the digest
    of its output."""
    reps = max(1, int(2e8 / (x.shape[0] * w.in_features * w.out_features)))
    best = float("inf")
    out = ops.linear(x, w)
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = ops.linear(x, w)
        best = min(best, (time.perf_counter() - start) / reps)
    return best, hashlib.sha256(out.view(torch.int16).numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a GGUF file")
    parser.add_argument("--tensors", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight")
    parser.add_argument("--rows", default="1,16,32,64,512,2048")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    lib = load_cpu_kernels()
    if lib is None:
        raise SystemExit("no CPU kernel library could be loaded or built")
    ops = CpuLayerOps(lib)
    machine = machine_info()
    amx = lib.nanoserve_quant_amx() if hasattr(lib, "nanoserve_quant_amx") else "none (a library from before them)"
    print(f"CPU {machine['cpu']} ({', '.join(machine['flags'])}), load average {machine['load_before']}; "
          f"quant isa {lib.nanoserve_quant_isa()}, AMX tiles {amx}")
    tensors = {t.name: t for t in GGUFReader(args.file).tensors}
    gen = torch.Generator().manual_seed(0)
    for name in args.tensors.split(","):
        t = tensors[name]
        blocks = torch.from_numpy(np.array(t.data)).reshape(-1, t.data.shape[-1])
        w = BlockQuantWeight(KEPT_TYPES[t.tensor_type], blocks, int(t.shape[0]), torch.bfloat16)
        print(f"{name}: {w.format} [{w.out_features}, {w.in_features}]")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, w.in_features, generator=gen).to(torch.bfloat16)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                s, digest = best_seconds(ops, x, w, args.rounds)
                print(f"  rows {rows:5d}  threads {threads}: {rows * w.in_features * w.out_features / s / 1e9:7.1f} "
                      f"GMAC/s  ({s * 1e3:8.3f} ms, output {digest})", flush=True)


if __name__ == "__main__":
    main()
