"""`nanoserve generate`: print a continuation of a prompt as it is generated. Its parser imports
nothing heavy; `run` imports the engine."""

from __future__ import annotations

import argparse
import sys

from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from
from nanoserve.settings import add_config_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate a continuation of a prompt")
    add_model_arg(p)
    add_config_arg(p)
    p.add_argument("--prompt", help="the text to continue (required, here or in the environment or --config)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                                                            "whose probabilities sum to this")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--chat", action="store_true", default=False,
                   help="render the prompt as a user message through the chat template")
    add_engine_args(p)
    p.set_defaults(func=run, max_num_seqs=1)


def run(ns: argparse.Namespace) -> int:
    if ns.prompt is None:
        raise ValueError("give a prompt: --prompt TEXT")
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.runtime.builder import build_engine

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

