"""Speculative decoding benchmark: the same greedy requests with speculation off and on, side by
side in one process, at several batch sizes.

Workloads:
- `chat`: short questions in the demo corpus's style, through the chat template;
- `repeat`: prompts that quote a passage and ask for it again, so the answer copies the prompt
  (the case prompt lookup is made for).

Reported per batch size: output tok/s without and with speculation (medians of alternating runs),
the speed-up, the draft acceptance rate and the mean tokens per verification (accepted drafts + 1).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from nanoserve.bench.throughput import format_table
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm import build_engine
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import SpecStats
from nanoserve.model import LoadedModel, load_model

_QUESTIONS = ("What is the capital of France?", "Tell me a short story about a cat.", "What is 12 + 30?",
              "Name the days of the week.", "What colour is the sky?", "Count from one to ten.",
              "What do bees make?", "List the months of the year.")
_PASSAGES = ("def add(a, b):\n    return a + b\n\n\n"
             "def scale(values, factor):\n    return [v * factor for v in values]\n",
             "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. ",
             "The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun. ")
WORKLOADS = ("chat", "repeat")


def workload_messages(kind: str, n: int) -> list[list[dict[str, str]]]:
    if kind == "chat":
        return [[{"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)]}] for i in range(n)]
    return [[{"role": "user", "content": "Repeat this text exactly:\n" + _PASSAGES[i % len(_PASSAGES)] * 3}]
            for i in range(n)]


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    args: EngineArgs  # with the speculation to measure; the baseline is the same without it
    workload: str = "chat"
    batch_sizes: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    repeats: int = 3  # alternating plain and speculative runs; each rate is the median of its runs


def _timed(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(d.token_ids) for d in engine.step())
    return time.perf_counter() - start, tokens


def run_spec_bench(cfg: SpecBenchConfig, loaded: LoadedModel | None = None) -> list[dict[str, Any]]:
    """One row per batch size; the engines share the loaded target model. Plain and speculative
    runs alternate `repeats` times (a fresh engine each, so neither inherits the other's cache
    state), and each rate is the median of its runs: a run of a second or less on a shared machine
    moves by tens of percent. Greedy decoding makes every speculative run accept the same drafts;
    acceptance is that of the last one."""
    if cfg.args.spec_method is None:
        raise ValueError("give --speculative-model or --speculative-method ngram")
    if cfg.repeats < 1:
        raise ValueError("repeats must be at least 1")
    loaded = loaded or load_model(cfg.args.model, dtype=cfg.args.dtype, device=cfg.args.device)
    base = dataclasses.replace(cfg.args, speculative_method=None, speculative_model=None, enable_prefix_caching=False)
    spec = dataclasses.replace(cfg.args, enable_prefix_caching=False)
    rows = []
    for bs in cfg.batch_sizes:
        prompts = [loaded.tokenizer.encode_chat(m) for m in workload_messages(cfg.workload, bs)]
        rates: dict[bool, list[float]] = {False: [], True: []}
        stats = SpecStats()
        for _ in range(cfg.repeats):
            for speculating, args in ((False, base), (True, spec)):
                engine = build_engine(dataclasses.replace(args, max_num_seqs=max(bs, 1)), loaded)
                _timed(engine, prompts[:1], 4)  # warm-up
                engine.spec_stats = SpecStats()
                elapsed, tokens = _timed(engine, prompts, cfg.max_tokens)
                rates[speculating].append(tokens / elapsed)
                if speculating:
                    stats = engine.spec_stats
        plain, fast = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append({"batch": bs, "plain_tok_s": plain, "spec_tok_s": fast, "speedup": fast / plain,
                     "plain_runs": rates[False], "spec_runs": rates[True], "acceptance_rate": stats.acceptance_rate,
                     "mean_accepted_length": stats.mean_accepted_length})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["batch", "plain tok/s", "spec tok/s", "speed-up", "acceptance", "tokens/verify"]
    return format_table(headers, [[str(r["batch"]), f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                                   f"{r['speedup']:.2f}x", f"{r['acceptance_rate']:.1%}",
                                   f"{r['mean_accepted_length']:.2f}"] for r in rows])
