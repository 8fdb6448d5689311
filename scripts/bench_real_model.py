"""A real trained model (default SmolLM2-135M-Instruct Q4_1, from the package registry): nanoserve
against llama.cpp on the same file. Prints one JSON line per measurement.

Usage: PYTHONPATH=TREE python scripts/bench_real_model.py [--model smollm2-135m-instruct]
       [--threads 1 2] [--batch 16] [--skip-speed] [--skip-agreement]

Speed: decode tok/s, single stream and batch B, for nanoserve as it loads the file by default (bf16;
Q8_0, Q4_0, Q4_K, Q5_K, Q6_K matrices kept in blocks, other types dequantized to bf16), nanoserve
with `--quantization dense` (every matrix bf16) and llama.cpp (llama-cpp-python, batched decodes
through `llama_decode`; `use_extra_bufts` off on CPUs with AMX-INT8, where its AMX product crashes),
each engine in a fresh process at each thread count (`nanoserve.bench.quant.run_isolated`), random
prompts of 16 tokens, greedy with EOS ignored, the same prompts for every engine.

Agreement: 8 chat prompts rendered by nanoserve's tokenizer (the same ids go to both engines), 64
greedy tokens each with EOS ignored, nanoserve (one batch of 8) in each mode against llama.cpp (one
prompt at a time): the positions equal before the first divergence, and at that step the margin
each engine gives its own choice over the other's (logprob difference; a near tie when either is
below NEAR_TIE: one engine sees the two tokens as all but equal, so a small numeric difference
flips it; nanoserve's bf16 logits are bf16-rounded, so its margins there come in steps of 1/8 or
1/4 and 0 is an exact tie).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np
import torch

from nanoserve.bench.quant import BLOCK_SIZE, Job, machine_info, run_isolated
from nanoserve.bench.workloads import Workload
from nanoserve.kv.manager import blocks_needed
from nanoserve.model.checkpoint import registry_models

PROMPT_LEN = 16
NEAR_TIE = 0.1
TOP = 20
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
]
MODES: dict[str, dict[str, Any]] = {
    "nanoserve bf16": {"dtype": "bfloat16"},
    "nanoserve fp32": {"dtype": "float32"},
    "nanoserve fp32 dense": {"dtype": "float32", "quantization": "dense"},
}


def speed(path: str, threads: int, batch: int, single_tokens: int, batch_tokens: int, vocab: int,
          extra_buffers: bool) -> None:
    singles = (Workload.random(1, (PROMPT_LEN, PROMPT_LEN), (single_tokens, single_tokens), vocab, 1000),)
    batches = (Workload.random(batch, (PROMPT_LEN, PROMPT_LEN), (batch_tokens, batch_tokens), vocab, batch),)
    kv_blocks = max(blocks_needed(PROMPT_LEN + single_tokens, BLOCK_SIZE),
                    batch * blocks_needed(PROMPT_LEN + batch_tokens, BLOCK_SIZE))
    runs = {"nanoserve bf16": ("nanoserve", ()), "nanoserve bf16 dense": ("nanoserve", (("quantization", "dense"),)),
            "llama.cpp": ("llama.cpp", ())}
    rates: dict[str, tuple[float, float]] = {}
    for label, (engine, options) in runs.items():
        job = Job(engine, path, singles, batches, threads, 0, "bfloat16", PROMPT_LEN + max(single_tokens, batch_tokens),
                  kv_blocks, options, extra_buffers)
        r = run_isolated(job)
        rates[label] = (r.rate(1), r.rate(batch))
        print(json.dumps({"speed": label, "threads": threads, "single_tok_s": round(r.rate(1), 1),
                          f"batch{batch}_tok_s": round(r.rate(batch), 1),
                          "peak_rss_mb": round(r.memory.peak / 1e6)}), flush=True)
    base = rates["llama.cpp"]
    for label, (one, many) in rates.items():
        if label != "llama.cpp":
            print(json.dumps({"ratio": f"{label} / llama.cpp", "threads": threads, "single": round(one / base[0], 2),
                              f"batch{batch}": round(many / base[1], 2)}), flush=True)


def llama_cpp_greedy(path: str, prompts: list[list[int]], steps: int,
                     threads: int) -> list[tuple[list[int], list[np.ndarray]]]:
    """Each prompt's greedy tokens and, per step, the log-softmax of the logits it was chosen from
    (through `Llama`, which keeps llama.cpp's default `use_extra_bufts`)."""
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(map(len, prompts)) + steps, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens, logprobs = [], []
        for _ in range(steps):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            lp = logits - logits.max()
            lp -= np.log(np.exp(lp).sum())
            tokens.append(int(lp.argmax()))
            logprobs.append(lp)
            llm.eval([tokens[-1]])
        out.append((tokens, logprobs))
    llm.close()
    return out


def agreement(path: str, steps: int, threads: int) -> None:
    from nanoserve.engine.sampling_params import SamplingParams
    from nanoserve.runtime.llm import LLM

    torch.set_num_threads(threads)
    reference: list[tuple[list[int], list[np.ndarray]]] | None = None
    prompts: list[list[int]] = []
    for label, options in MODES.items():
        llm = LLM(path, max_model_len=256, num_kv_blocks=160, **options)
        if reference is None:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
            reference = llama_cpp_greedy(path, prompts, steps, threads)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True,
                                                    logprobs=TOP))
        rows = []
        for (theirs, their_lp), out in zip(reference, outs, strict=True):
            c = out.outputs[0]
            ours = list(c.token_ids)
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
            row: dict[str, Any] = {"equal_prefix": steps if first is None else first}
            if first is not None:
                assert c.top_logprobs is not None and c.logprobs is not None
                top = dict(c.top_logprobs[first])
                our_margin = c.logprobs[first] - top.get(theirs[first], -np.inf)
                their_margin = float(their_lp[first][theirs[first]] - their_lp[first][ours[first]])
                row.update(ours=round(our_margin, 4), llama_cpp=round(their_margin, 4),
                           near_tie=bool(min(our_margin, their_margin) < NEAR_TIE))
            rows.append(row)
        print(json.dumps({"agreement": f"{label} vs llama.cpp", "threads": threads, "steps": steps,
                          "identical": sum(r["equal_prefix"] == steps for r in rows), "prompts": rows}), flush=True)
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=list(registry_models.CATALOGUE))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt in the agreement run")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ns = ap.parse_args()
    path = str(registry_models.fetch(ns.model))
    machine = machine_info()
    extra_buffers = "amx_int8" not in machine["flags"]
    print(json.dumps({"model": ns.model, "file": os.path.basename(path), **machine,
                      "llama_cpp_use_extra_bufts": extra_buffers}), flush=True)
    if not ns.skip_speed:
        from nanoserve.model.checkpoint.gguf_reader import read_gguf_metadata

        vocab = len(read_gguf_metadata(path)["tokenizer.ggml.tokens"])
        for threads in ns.threads:
            speed(path, threads, ns.batch, ns.single_tokens, ns.batch_tokens, vocab, extra_buffers)
    if not ns.skip_agreement:
        if not extra_buffers:
            raise SystemExit("the agreement run loads llama.cpp through Llama, which repacks for AMX (it crashes "
                             "there): use --skip-agreement")
        agreement(path, ns.steps, max(ns.threads))
    print(json.dumps({"load_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
