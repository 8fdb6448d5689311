"""`nanoserve bench spec`: speculative decoding against plain decoding, side by side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nanoserve.bench.spec import WORKLOADS, SpecBenchConfig, format_rows, run_spec_bench
from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from


def register_spec(kinds: argparse._SubParsersAction) -> None:
    s = kinds.add_parser("spec", help="speculative decoding vs plain decoding",
                         description="The same greedy requests (ignore_eos) with speculation off and on, at each "
                                     "batch size; give --speculative-model (a draft) or --speculative-method ngram, "
                                     "or --workload edit: without and with a prediction (Predicted Outputs).")
    add_model_arg(s)
    s.add_argument("--workload", choices=WORKLOADS, default="chat",
                   help="chat: short questions; repeat: the answer copies a passage quoted in the prompt; "
                        "edit: small edits to a code file, without and with a prediction (the answer with five "
                        "small edits); "
                        "edit-file: the same, predicted by the file itself")
    s.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--repeats", type=int, default=3,
                   help="rounds of interleaved plain and speculative runs per batch size; the medians are reported")
    s.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    add_engine_args(s)
    s.set_defaults(func=run_spec)


def run_spec(ns: argparse.Namespace) -> int:
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    cfg = SpecBenchConfig(engine_args_from(ns), ns.workload, tuple(ns.batch_sizes), ns.max_tokens, ns.repeats)
    rows = run_spec_bench(cfg)
    method = cfg.args.speculative_model or cfg.args.spec_method
    if cfg.workload.startswith("edit"):
        method = f"prediction (server speculation: {method})"
    print(f"speculation={method} k={cfg.args.num_speculative_tokens} workload={cfg.workload} "
          f"max_tokens={cfg.max_tokens} repeats={cfg.repeats} (medians)\n")
    print(format_rows(rows))
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0
