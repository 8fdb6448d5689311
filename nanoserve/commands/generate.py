"""`nanoserve generate`: print a continuation of a prompt as it is generated."""

from __future__ import annotations

import argparse
import sys

from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.runtime.builder import build_engine


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate a continuation of a prompt")
    add_model_arg(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="render the prompt as a user message through the chat template")
    add_engine_args(p)
    p.set_defaults(func=run, max_num_seqs=1)


def run(ns: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            seed=ns.seed)
    engine = build_engine(engine_args_from(ns))
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode_chat([{"role": "user", "content": ns.prompt}]) if ns.chat else tok.encode(ns.prompt)
    engine.add_request("cli", ids, params)
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0

