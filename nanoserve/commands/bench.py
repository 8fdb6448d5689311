"""`nanoserve bench`: benchmarks. `bench throughput` runs random requests through the engine offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nanoserve.bench.throughput import COMPARISONS, ThroughputConfig, run_throughput
from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    kinds = p.add_subparsers(dest="bench", required=True)
    t = kinds.add_parser("throughput", help="offline engine throughput over random requests",
                         description="N requests with random prompt token ids and random output lengths "
                                     "(greedy, ignore_eos) through one engine; prints requests/s and tokens/s.")
    add_model_arg(t)
    t.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    t.add_argument("--input-len-range", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]")
    t.add_argument("--output-len-range", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX]")
    t.add_argument("--stand-in", action="store_true",
                   help="use the deterministic stand-in model (no weights): measures engine bookkeeping")
    t.add_argument("--compare", choices=COMPARISONS,
                   help="sequential: the same requests one at a time; contiguous: paged vs contiguous KV "
                        "layout under the same pool (max_model_len 2048 unless given)")
    t.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    t.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    add_engine_args(t)
    t.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    cfg = ThroughputConfig(engine_args_from(ns), ns.num_prompts, tuple(ns.input_len_range),
                           tuple(ns.output_len_range), ns.stand_in, ns.compare)
    report = run_throughput(cfg)
    print(report.format())
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0
