"""The quantized products alone: real tensors of a GGUF file times random activations, GMAC/s.

Usage: python scripts/bench_products.py FILE.gguf [--tensors blk.0.ffn_gate.weight,blk.0.ffn_down.weight]
       [--rows 1,16,32,64,512,2048] [--threads 1,2] [--rounds 3] [--against OTHER.so]

For each tensor, row count and thread count: `CpuLayerOps.linear` of bf16 x [rows, in] against the
tensor as the file stores it (kept quantized), through the kernel library this tree loads (no
Python per call beyond the op's own). Prints the best of --rounds in GMAC/s and a digest of the
output's bytes: run it from two trees (PYTHONPATH, from a folder outside both) to compare kernels,
the digests saying whether both computed the same bits. The CPU, its kernel-relevant flags, the
path the products take (`nanoserve_quant_isa`, and whether the k-quants' many-row products take AMX
tiles) and the load average are printed first.

With --against LIB (another tree's kernel library file, e.g. its `nanoserve/kernels/*.so` or the
build under its $NANOSERVE_CACHE/kernels), both libraries run in this one process, alternately:
each of --rounds rounds times one batch of calls with each (in alternating order), and the medians
are printed with their ratio and whether the two outputs are the same bits. Memory bandwidth on a
shared machine drifts by several % over minutes, which separate processes see as a difference;
alternating round by round in one process puts the drift on both sides.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader

from nanoserve.bench.quant import machine_info
from nanoserve.model.checkpoint.gguf_reader import KEPT_TYPES
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.quant.block_quant import BlockQuantWeight
from nanoserve.native import load_cpu_kernels, load_kernel_file


def repetitions(x: torch.Tensor, w: BlockQuantWeight) -> int:
    """Calls of one product in a timed batch: ~2e8 multiply-adds, at least one."""
    return max(1, int(2e8 / (x.shape[0] * w.in_features * w.out_features)))


def batch_seconds(ops: CpuLayerOps, x: torch.Tensor, w: BlockQuantWeight, reps: int) -> float:
    """The mean wall time of one product over a batch of `reps` calls."""
    start = time.perf_counter()
    for _ in range(reps):
        ops.linear(x, w)
    return (time.perf_counter() - start) / reps


def digest(ops: CpuLayerOps, x: torch.Tensor, w: BlockQuantWeight) -> str:
    """A digest of the product's output bytes."""
    return hashlib.sha256(ops.linear(x, w).view(torch.int16).numpy().tobytes()).hexdigest()[:12]


def best_seconds(ops: CpuLayerOps, x: torch.Tensor, w: BlockQuantWeight, rounds: int) -> tuple[float, str]:
    """Best of `rounds` wall times of one product (each round a batch of ~0.2 s), and the digest
    of its output."""
    out = digest(ops, x, w)
    reps = repetitions(x, w)
    return min(batch_seconds(ops, x, w, reps) for _ in range(rounds)), out


def alternated_seconds(ours: CpuLayerOps, theirs: CpuLayerOps, x: torch.Tensor, w: BlockQuantWeight,
                       rounds: int) -> tuple[float, float]:
    """The median wall times of one product through each library over `rounds` rounds, each round
    one batch with each, the first round ours first, the next theirs first, and so on."""
    reps = repetitions(x, w)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(rounds):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append(batch_seconds((ours, theirs)[side], x, w, reps))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a GGUF file")
    parser.add_argument("--tensors", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight")
    parser.add_argument("--rows", default="1,16,32,64,512,2048")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another build of the kernel library, timed alternately")
    args = parser.parse_args()
    lib = load_cpu_kernels()
    if lib is None:
        raise SystemExit("no CPU kernel library could be loaded or built")
    ops = CpuLayerOps(lib)
    other = CpuLayerOps(load_kernel_file(args.against)) if args.against is not None else None
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
                macs = rows * w.in_features * w.out_features
                if other is None:
                    s, out = best_seconds(ops, x, w, args.rounds)
                    print(f"  rows {rows:5d}  threads {threads}: {macs / s / 1e9:7.1f} GMAC/s  ({s * 1e3:8.3f} ms, "
                          f"output {out})", flush=True)
                    continue
                same = "same" if digest(ops, x, w) == digest(other, x, w) else "DIFFERENT"
                mine, theirs = alternated_seconds(ops, other, x, w, args.rounds)
                print(f"  rows {rows:5d}  threads {threads}: this tree {macs / mine / 1e9:7.1f} GMAC/s "
                      f"({mine * 1e3:8.3f} ms), --against {macs / theirs / 1e9:7.1f} ({theirs * 1e3:8.3f} ms): "
                      f"this tree {theirs / mine:.3f}x as fast; outputs {same}", flush=True)


if __name__ == "__main__":
    main()
