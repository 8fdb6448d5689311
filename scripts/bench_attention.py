"""The CPU paged-attention kernel alone: one step's attention over every layer of a model shape.

Usage: python scripts/bench_attention.py [--shape qwen3-0.6b] [--contexts 160,512,2048]
       [--sequences 1,16] [--threads 1,2] [--query-tokens 1] [--dtype bfloat16] [--rounds 9]

For each context length, sequence count and thread count: `--query-tokens` new tokens per sequence
(1: a decode step; more: a prefill chunk, the last tokens of the context, causal among themselves)
against `context` cached tokens, through every layer in turn (each layer its own pool, the
shape's heads and head size, blocks of 16 tokens in a random order, as a long-running server's pool
hands them out), called through the kernel library's C entry point (no Python per call beyond
ctypes). Prints the best of --rounds for the whole step (all layers), and the K and V bytes read per
second (a decode) or the (query row, key) pairs scored per second (a chunk). Run it from two trees
(PYTHONPATH) to compare kernels; the CPU and load average are printed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from nanoserve.bench.quant import machine_info
from nanoserve.bench.shapes import PRESETS
from nanoserve.native import load_cpu_kernels

BLOCK = 16


def step_seconds(entry: Callable[..., int], q: torch.Tensor, pools: list[torch.Tensor], tables: torch.Tensor,
                 lens: torch.Tensor, starts: torch.Tensor, threads: int, rounds: int) -> float:
    """Best of `rounds` wall times of one decode step's attention over all `pools` (one per layer)."""
    _, num_blocks, _, kv_heads, head_dim = pools[0].shape
    seqs, heads = tables.shape[0], q.shape[1]
    out = torch.empty_like(q)
    reps = max(1, int(2e8 / (int(lens.sum()) * q.shape[0] // seqs * heads * head_dim * len(pools))))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            for pool in pools:
                entry(q.data_ptr(), heads * head_dim, pool.data_ptr(), out.data_ptr(), tables.data_ptr(),
                      tables.shape[1], lens.data_ptr(), starts.data_ptr(), seqs, heads, kv_heads, head_dim, BLOCK,
                      num_blocks, head_dim**-0.5, threads)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(PRESETS))
    parser.add_argument("--contexts", default="160,512,2048")
    parser.add_argument("--sequences", default="1,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--query-tokens", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    lib = load_cpu_kernels()
    if lib is None:
        raise SystemExit("no CPU kernel library on this machine")
    dtype = getattr(torch, args.dtype)
    entry = lib.nanoserve_paged_attention_bf16 if dtype == torch.bfloat16 else lib.nanoserve_paged_attention_f32
    cfg = PRESETS[args.shape]
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    machine = machine_info()
    print(f"{args.shape}: {layers} layers, {heads} query / {kv_heads} KV heads of {head_dim}, {args.dtype}; "
          f"CPU {machine['cpu']} ({', '.join(machine['flags'])}), load average {machine['load_before']}")
    gen = torch.Generator().manual_seed(0)
    new = args.query_tokens
    for context in (int(c) for c in args.contexts.split(",")):
        for seqs in (int(s) for s in args.sequences.split(",")):
            per_seq = -(-context // BLOCK)
            pools = [torch.randn(2, per_seq * seqs, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
                     for _ in range(layers)]
            tables = torch.randperm(per_seq * seqs, generator=gen).view(seqs, per_seq).contiguous()
            lens, starts = torch.full((seqs,), context), torch.arange(seqs + 1) * new
            q = torch.randn(seqs * new, heads, head_dim, generator=gen).to(dtype)
            kv_bytes = 2 * context * kv_heads * head_dim * pools[0].element_size() * layers * seqs
            pairs = seqs * heads * layers * sum(context - new + 1 + i for i in range(new))
            for threads in (int(t) for t in args.threads.split(",")):
                s = step_seconds(entry, q, pools, tables, lens, starts, threads, args.rounds)
                rate = (f"{kv_bytes / s / 1e9:5.1f} GB/s of K and V" if new == 1
                        else f"{pairs / s / 1e9:6.2f} G (row, key) pairs/s")
                print(f"context {context:5d}  sequences {seqs:3d}  new {new:4d}  threads {threads}: {s * 1e3:8.2f} ms "
                      f"a step ({rate})", flush=True)


if __name__ == "__main__":
    main()
