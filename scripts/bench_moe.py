"""Mixture of experts at the Qwen3-30B-A3B shape: the GGUF files, llama.cpp on them, and moe.cpp's
routed feed-forward against the bytes it must read.

Usage: python scripts/bench_moe.py [--layers 4] [--formats Q8_0,Q4_K_M] [--threads 1,2] [--out DIR]
       [--json PATH] [--no-llama-cpp] [--rounds 3]; or --end-to-end FILE --threads N (nanoserve alone)

1. Writes (once, into --out) a `qwen3moe` GGUF file per format with random but valid blocks (finite
   fp16 scales): Qwen3-30B-A3B's widths (hidden 2048, 128 experts of width 768, top-8, 32 query and 4
   key/value heads of 128, vocabulary 151936, untied head) with --layers layers instead of 48. Q8_0
   stores every matrix in q8_0; Q4_K_M follows llama.cpp's mix (llama-quant.cpp): q4_k by default,
   q6_k for attn_v and ffn_down(_exps) in its "more bits" layers (the last eighth and every third
   from the first eighth on) and for the LM head; norms and the router in f32. The tokenizer is
   nanoserve's demo tokenizer, padded to the vocabulary.
2. llama.cpp on each file: `llama-bench -p 0 -n 64` (single-stream decode, each --threads count) and
   `llama-batched-bench -npp 16 -ntg 32 -npl 16,64` (decode of 16 and 64 sequences), each process's
   peak resident memory (its rusage); without their repacked layouts (`--repack 0`, `--no-repack`)
   on a CPU with AMX-INT8, where llama.cpp's AMX path crashes.
3. nanoserve.LLM on each file, in a process of its own per --threads count: decode of 1, 16 and 64
   streams (greedy, 16-token prompts), the process's peak resident memory.
4. moe.cpp: one layer's `CpuLayerOps.moe_ffn` on the file's expert tensors (read into memory), for
   1, 16 and 64 tokens routed uniformly at random (a fresh routing and the next layer's experts each
   call, so no expert stays in cache between calls), against the bytes of the distinct experts it
   reads: GB/s and the fraction of the machine's read bandwidth (nanoserve.bench.roofline).
5. Where llama.cpp's test-backend-ops is built (TEST_BACKEND_OPS, default beside llama-bench), its
   perf mode's own Qwen3-30B-A3B cases of the grouped product (MUL_MAT_ID) alternated --rounds times
   with moe_ffn on the same shape and format, both at one thread with the experts hot in cache
   (as test-backend-ops runs them): a layer is three of its products (gate, up, down) against one
   moe_ffn call.

Prints a table and one JSON object (also written to --json), with the CPU and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import torch

from nanoserve.bench.llama_server import cpu_has_amx
from nanoserve.bench.quant import machine_info
from nanoserve.bench.roofline import measure_roofline
from nanoserve.cache import cache_root
from nanoserve.model.checkpoint.gguf_export import _write_tokenizer
from nanoserve.model.demo import demo_model_path
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight
from nanoserve.native import load_cpu_kernels

LLAMA_BIN = cache_root() / "llama-server" / "build" / "bin"
# test-backend-ops, built beside it (not a default target): see docs/benchmarks.md for the command.
TEST_BACKEND_OPS = Path(os.environ.get("TEST_BACKEND_OPS", LLAMA_BIN / "test-backend-ops"))
# Qwen/Qwen3-30B-A3B config.json, less its layers.
HIDDEN, EXPERTS, EXPERT_WIDTH, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 128, 768, 8, 32, 4, 128, 151936
Q = gguf.GGMLQuantizationType
# Byte offsets of each format's fp16 scales within a block.
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def more_bits(layer: int, layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: where Q4_K_M stores attn_v and ffn_down in q6_k."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(fmt: str, layers: int) -> dict[str, Q]:
    """Each matrix's GGUF type in file format `fmt` (Q8_0 or Q4_K_M)."""
    names = ["token_embd.weight", "output.weight"] + [
        f"blk.{i}.{t}.weight" for i in range(layers)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    if fmt == "Q8_0":
        return dict.fromkeys(names, Q.Q8_0)
    types = dict.fromkeys(names, Q.Q4_K)
    types["output.weight"] = Q.Q6_K
    for i in range(layers):
        if more_bits(i, layers):
            types[f"blk.{i}.attn_v.weight"] = types[f"blk.{i}.ffn_down_exps.weight"] = Q.Q6_K
    return types


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as numpy orders it (rows last-but-one, values per row last)."""
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
                                       "output.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (HIDDEN,), b + "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                b + "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN), b + "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                b + "attn_output.weight": (HIDDEN, HEADS * HEAD_DIM), b + "attn_q_norm.weight": (HEAD_DIM,),
                b + "attn_k_norm.weight": (HEAD_DIM,), b + "ffn_norm.weight": (HIDDEN,),
                b + "ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                b + "ffn_gate_exps.weight": (EXPERTS, EXPERT_WIDTH, HIDDEN),
                b + "ffn_up_exps.weight": (EXPERTS, EXPERT_WIDTH, HIDDEN),
                b + "ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_WIDTH)}
    return out


def random_tensor(shape: tuple[int, ...], qtype: Q | None, rng: np.random.Generator) -> np.ndarray:
    """f32 values near 1 (norms) or N(0, 0.02) (the router) for qtype None; else random bytes
    with fp16 scales of +-[0.0005, 0.002] (q8_0's quants in [-127, 127]) as uint8 [..., row_bytes]."""
    if qtype is None:
        return (1 + 0.02 * rng.standard_normal(shape) if len(shape) == 1 else
                0.02 * rng.standard_normal(shape)).astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.0005, 0.002, blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q8_0:
        quants = blocks[:, 2:].view(np.int8)
        quants[quants == -128] = -127
    return raw


def write_model(path: Path, fmt: str, layers: int, seed: int = 0) -> Path:
    """The file (see the module docstring), written once: tensor infos first, then each tensor
    generated and written in turn, so no more than one is in memory."""
    if path.exists():
        return path
    types = tensor_types(fmt, layers)
    all_shapes = shapes(layers)
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "qwen3moe")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"qwen3-30b-a3b-shape-{layers}-layers")
    writer.add_block_count(layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_expert_feed_forward_length(EXPERT_WIDTH)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(TOP_K)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if fmt == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, demo_model_path(cache_root()), VOCAB)
    for name, shape in all_shapes.items():
        qtype = types.get(name)
        if qtype is None:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in all_shapes.items():
        writer.write_tensor_data(random_tensor(shape, types.get(name), rng))
    writer.close()
    tmp.rename(path)
    return path


def run_measured(cmd: list[str]) -> tuple[str, int]:
    """The command's stdout and its peak resident memory in bytes (its own rusage)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
    return out, usage.ru_maxrss * 1024


def llama_cpp(path: Path, threads: list[int]) -> dict[str, Any]:
    """llama-bench's single-stream decode per thread count, llama-batched-bench's decode at 16 and
    64 sequences (the most threads), the peak resident memory of each. On a CPU with AMX-INT8 both
    run without their repacked layouts (llama.cpp's AMX path crashes there)."""
    amx = cpu_has_amx()
    out, rss = run_measured([str(LLAMA_BIN / "llama-bench"), "-m", str(path), "-p", "0", "-n", "64", "-r", "2",
                             "-t", ",".join(map(str, threads)), "-o", "json", *(["--repack", "0"] if amx else [])])
    single = {int(r["n_threads"]): r["avg_ts"] for r in json.loads(out)}
    out, batch_rss = run_measured([str(LLAMA_BIN / "llama-batched-bench"), "-m", str(path), "-c", "8192",
                                   "-b", "2048", "-ub", "512", "-npp", "16", "-ntg", "32", "-npl", "16,64",
                                   "-t", str(max(threads)), "--output-format", "jsonl",
                                   *(["--no-repack"] if amx else [])])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    batch = {int(r["pl"]): r["speed_tg"] for r in rows if "pl" in r}
    return {"single_tok_s": single, "batch_tok_s": batch, "peak_rss_single": rss, "peak_rss_batch": batch_rss}


def expert_weights(path: Path, layers: int) -> list[tuple[BlockQuantWeight, BlockQuantWeight, BlockQuantWeight]]:
    """Each layer's gate, up and down experts as stacked BlockQuantWeights: the file's bytes, read
    into memory (as the loader does; a memory map would fault its pages in during the timing)."""
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out = []
    for i in range(layers):
        parts = []
        for name, in_features in (("gate", HIDDEN), ("up", HIDDEN), ("down", EXPERT_WIDTH)):
            t = by_name[f"blk.{i}.ffn_{name}_exps.weight"]
            fmt = next(f.name for f in BLOCK_FORMATS.values() if f.qtype == t.tensor_type)
            data = torch.from_numpy(np.array(t.data)).reshape(-1, BLOCK_FORMATS[fmt].row_bytes(in_features))
            parts.append(BlockQuantWeight(fmt, data, in_features, torch.bfloat16))
        out.append((parts[0], parts[1], parts[2]))
    return out


def expert_bytes(w: tuple[BlockQuantWeight, ...]) -> int:
    """The bytes of one expert's gate, up and down."""
    return sum(p.blocks.numel() for p in w) // EXPERTS


def timed_call(ops: CpuLayerOps, x: torch.Tensor, topk: torch.Tensor, w: tuple[BlockQuantWeight, ...],
               gen: torch.Generator | torch.Tensor) -> tuple[float, int]:
    """One moe_ffn call on a fresh uniform routing (or the ids given): its seconds and the bytes of
    the experts chosen."""
    ids = gen if isinstance(gen, torch.Tensor) else torch.rand(x.shape[0], EXPERTS, generator=gen).argsort(1)[:, :TOP_K]
    start = time.perf_counter()
    ops.moe_ffn(x, w[0], w[1], w[2], ids, topk)
    return time.perf_counter() - start, ids.unique().numel() * expert_bytes(w)


def kernel(path: Path, layers: int, threads: int, bandwidth: float, hot: bool, min_time: float = 2.0) -> dict[str, Any]:
    """moe_ffn per call at 1, 16 and 64 tokens (see the module docstring), at `threads` threads; `hot`:
    the same routing and layer every call (its experts then stay in the caches as far as they fit, as
    in llama.cpp's test-backend-ops perf mode)."""
    lib = load_cpu_kernels()
    assert lib is not None, "the CPU kernels did not build"
    ops = CpuLayerOps(lib)
    torch.set_num_threads(threads)
    weights = expert_weights(path, 1 if hot else layers)
    gen = torch.Generator().manual_seed(0)
    result = {}
    for tokens in (1, 16, 64):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        topk = torch.rand(tokens, TOP_K, generator=gen)
        route: torch.Generator | torch.Tensor = (torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
                                                 if hot else gen)
        for w in weights:  # warm-up
            timed_call(ops, x, topk, w, route)
        spent, read, calls = 0.0, 0, 0
        while spent < min_time or calls < 2 * len(weights):
            seconds, nbytes = timed_call(ops, x, topk, weights[calls % len(weights)], route)
            spent, read, calls = spent + seconds, read + nbytes, calls + 1
        rate = read / spent
        result[tokens] = {"us_per_call": 1e6 * spent / calls, "gb_s": rate / 1e9, "of_bandwidth": rate / bandwidth,
                          "tokens_per_s_of_layer": tokens * calls / spent}
    return result


def llama_cpp_mul_mat_id(fmt: str) -> dict[int, float]:
    """llama.cpp's own measure of its grouped product at this shape (test-backend-ops perf, its
    "qwen3-30b-a3b" cases: 128 experts, 8 used, [768, 2048] each, in fmt's gate type): us per
    call by tokens. One of a layer's three products; the layer is about three of them."""
    exe = TEST_BACKEND_OPS
    qtype = "q8_0" if fmt == "Q8_0" else "q4_K"
    out = subprocess.run([str(exe), "perf", "-o", "MUL_MAT_ID", "-b", "CPU", "-p",
                          rf"type_a={qtype},type_b=f32,n_mats=128,n_used=8,b=0,m=768,n=(1|64),k=2048"],
                         capture_output=True, text=True, check=True).stdout
    found = re.findall(r"n=(\d+),k=2048.*?:\s+\d+ runs -\s+([\d.]+) us/run", out)
    return {int(n): float(us) for n, us in found}


def side_by_side(path: Path, fmt: str, layers: int, bandwidth: float, rounds: int) -> dict[str, Any]:
    """`rounds` alternations of llama.cpp's grouped product (test-backend-ops: one thread on two
    cores) and moe_ffn at one thread on the same experts (layer 0: q4_k gate, up and down in the
    Q4_K_M file, q8_0 in the Q8_0 one), hot as test-backend-ops runs it; the medians, and llama.cpp's
    three products (a layer's gate, up and down) per moe_ffn call. Its cases are 1 and 64 tokens
    (and others, but not 16)."""
    peer: dict[int, list[float]] = {}
    ours: dict[int, list[float]] = {}
    for _ in range(rounds):
        for n, us in llama_cpp_mul_mat_id(fmt).items():
            peer.setdefault(n, []).append(us)
        for n, r in kernel(path, layers, 1, bandwidth, hot=True, min_time=1.0).items():
            ours.setdefault(n, []).append(r["us_per_call"])
    median = {n: float(np.median(v)) for n, v in peer.items()}
    mine = {n: float(np.median(v)) for n, v in ours.items()}
    return {"rounds": rounds, "llama_cpp_mul_mat_id_us": median, "moe_ffn_us": mine,
            "speedup_vs_three_mul_mat_id": {n: 3 * median[n] / mine[n] for n in mine if n in median},
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def nanoserve_end_to_end(path: Path, threads: int) -> dict[str, Any]:
    """nanoserve.LLM on the file in a process of its own (`--end-to-end`): decode tok/s of 1, 16 and
    64 streams (greedy 16-token prompts; a 64- or 32-token generation less a 2-token one) and the
    process's peak resident memory."""
    out = subprocess.run([sys.executable, __file__, "--end-to-end", str(path), "--threads", str(threads)],
                         capture_output=True, text=True, check=True).stdout
    return cast(dict[str, Any], json.loads(out.strip().splitlines()[-1]))


def end_to_end(path: Path, threads: int) -> None:
    """The body of `nanoserve_end_to_end`, printing its JSON last."""
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.runtime.llm import LLM

    torch.set_num_threads(threads)
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64 * 4 + 16, max_num_seqs=64)

    def seconds(batch: int, tokens: int) -> float:
        prompts = [[(7 * b + i) % 1000 + 10 for i in range(16)] for b in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - start

    rates = {batch: batch * (n - 2) / (seconds(batch, n) - seconds(batch, 2))
             for batch, n in ((1, 64), (16, 32), (64, 32))}
    print(json.dumps({"decode_tok_s": rates, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--formats", default="Q8_0,Q4_K_M")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path, default=cache_root() / "bench-moe")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the kernel-level comparison")
    parser.add_argument("--end-to-end", type=Path, help="only nanoserve.LLM on this file (at the first --threads)")
    ns = parser.parse_args()
    threads = [int(t) for t in ns.threads.split(",")]
    if ns.end_to_end:
        end_to_end(ns.end_to_end, threads[0])
        return
    ns.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"machine": machine_info(), "layers": ns.layers, "formats": {}}
    roofs = {}
    for t in threads:
        torch.set_num_threads(t)
        roofs[t] = measure_roofline(torch.bfloat16, HIDDEN)
        report.setdefault("roofline", {})[t] = roofs[t].to_dict()
    for fmt in ns.formats.split(","):
        path = write_model(ns.out / f"qwen3-30b-a3b-shape-{ns.layers}l-{fmt}.gguf", fmt, ns.layers)
        entry: dict[str, Any] = {"file": str(path), "file_bytes": path.stat().st_size}
        if not ns.no_llama_cpp:
            entry["llama_cpp"] = llama_cpp(path, threads)
        entry["nanoserve"] = {t: nanoserve_end_to_end(path, t) for t in threads}
        entry["moe_ffn"] = {t: kernel(path, ns.layers, t, roofs[t].bandwidth, hot=False) for t in threads}
        if TEST_BACKEND_OPS.exists():
            entry["side_by_side"] = side_by_side(path, fmt, ns.layers, roofs[1].bandwidth, ns.rounds)
        report["formats"][fmt] = entry
    report["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for fmt, entry in report["formats"].items():
        print(f"{fmt}: {entry['file_bytes'] / 2**30:.2f} GiB, {ns.layers} layers")
        if "llama_cpp" in entry:
            lc = entry["llama_cpp"]
            repack = "off (an AMX-INT8 CPU)" if cpu_has_amx() else "on"
            print(f"  llama.cpp (repacked layouts {repack}) decode tok/s: "
                  + ", ".join(f"1 stream {t} threads {r:.1f}" for t, r in lc["single_tok_s"].items())
                  + "; " + ", ".join(f"{b} streams {r:.1f}" for b, r in lc["batch_tok_s"].items())
                  + f"; peak RSS {lc['peak_rss_single'] / 2**30:.2f} / {lc['peak_rss_batch'] / 2**30:.2f} GiB")
        for t, e2e in entry["nanoserve"].items():
            rates = ", ".join(f"{b} streams {r:.1f}" for b, r in e2e["decode_tok_s"].items())
            print(f"  nanoserve decode tok/s, {t} threads: {rates}; peak RSS {e2e['peak_rss'] / 2**30:.2f} GiB")
        print("  moe_ffn, one layer  | threads | tokens | us/call | GB/s | of read bandwidth")
        for t, rows in entry["moe_ffn"].items():
            for tokens, r in rows.items():
                print(f"  {'':19}| {t:7} | {tokens:6} | {r['us_per_call']:7.0f} | {r['gb_s']:4.1f} | "
                      f"{100 * r['of_bandwidth']:.0f}%")
        if "side_by_side" in entry:
            sb = entry["side_by_side"]
            print("  1 thread, hot: tokens | llama.cpp mul_mat_id us (x3 = a layer) | moe_ffn us | speed-up")
            for n, us in sb["moe_ffn_us"].items():
                if n not in sb["llama_cpp_mul_mat_id_us"]:  # its cases have no 16 tokens
                    continue
                print(f"  {'':15}{n:6} | {sb['llama_cpp_mul_mat_id_us'][n]:9.0f} | {us:9.0f} | "
                      f"{sb['speedup_vs_three_mul_mat_id'][n]:.2f}x")
    print(f"load average {report['machine']['load_before']} -> {report['load_after']}; {report['machine']['cpu']}")
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if ns.json:
        ns.json.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
