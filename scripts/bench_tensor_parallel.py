"""Tensor parallelism on this machine: engine step time at TP=1 and TP=2, and what the collectives
of a TP=2 step cost on their own.

Steps: one prefill of `--prefill` tokens, and decode steps of each batch size of `--batches`
(the median of the steps in which every sequence decodes). TP=1 runs twice, with all the cores as
torch threads and with one (on a loaded machine, threads that wait for each other at every
parallel region can lose far more than the second core gives); TP=2 gives each rank its share
(the cores / 2). The collectives are timed in two
processes of their own (gloo, one thread each): per step a TP=2 forward makes 2 all-reduces per
layer (after o_proj and down_proj) and one for the vocab-parallel embedding, all of
[tokens, hidden], one gather to rank 0 of the logits rows' vocab shards, and rank 0's two
broadcasts of the batch (a header and the payload: a few hundred bytes, timed as 64 int64).

    python scripts/bench_tensor_parallel.py                       # Qwen3-0.6B shape, random bf16 weights
    python scripts/bench_tensor_parallel.py --override num_hidden_layers=4 --batches 1 4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve.bench.shapes import parse_overrides, shape_checkpoint
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model.config import ModelConfig
from nanoserve.parallel.group import Rendezvous, TensorParallelGroup, free_port
from nanoserve.parallel.runner import TensorParallelRunner
from nanoserve.runtime.builder import build_engine


class Timing(NamedTuple):
    """A kind of step: its median wall time, and the CPU time all ranks spent on it (the mean over
    the steps measured; it counts work, and so is not inflated by other processes' load the way
    wall time is on a shared machine)."""

    wall: float
    cpu: float


def cpu_seconds(engine: LLMEngine) -> float:
    """User + system CPU seconds so far of this process and of the engine's worker ranks."""
    own = os.times()
    total = own.user + own.system
    runner = engine.runner
    if isinstance(runner, TensorParallelRunner):
        tick = os.sysconf("SC_CLK_TCK")
        for process in runner.workers.processes.values():
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def time_steps(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, prefill: bool) -> Timing:
    """Runs the prompts to completion; times the steps that prefill them all at once (`prefill`)
    or those in which every sequence decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    walls: list[float] = []
    cpu = 0.0
    while engine.has_unfinished():
        timed = engine.num_decoding_seqs() == len(prompts) if not prefill else not walls
        start, start_cpu = time.perf_counter(), cpu_seconds(engine)
        engine.step()
        if timed:
            walls.append(time.perf_counter() - start)
            cpu += cpu_seconds(engine) - start_cpu
    return Timing(statistics.median(walls), cpu / len(walls))


def measure_engine(path: Path, tp: int, threads: int, batches: list[int], prefill: int,
                   steps: int) -> dict[str, Timing]:
    torch.set_num_threads(threads)
    engine = build_engine(EngineArgs(model=str(path), tensor_parallel_size=tp, max_model_len=2048,
                                     max_num_batched_tokens=max(prefill, 256), enable_prefix_caching=False,
                                     num_kv_blocks=max(batches) * 8 + prefill // 16 + 8))
    try:
        prefills = [time_steps(engine, [[(r * 31 + j) % 200 + 10 for j in range(prefill)]], 1, True)
                    for r in range(3)]
        out = {"prefill": Timing(statistics.median(t.wall for t in prefills), statistics.mean(t.cpu for t in prefills))}
        for b in batches:
            prompts = [[(7 * i + j) % 200 + 10 for j in range(16)] for i in range(b)]
            out[f"decode b={b}"] = time_steps(engine, prompts, steps + 1, False)
        return out
    finally:
        engine.close()


def _collectives(rank: int, port: int, cfg: ModelConfig, dtype: torch.dtype, tokens: list[int], rows: list[int],
                 reps: int, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    group = TensorParallelGroup(Rendezvous("127.0.0.1", port, 2), rank, torch.device("cpu"), 60.0)

    def gather(t: torch.Tensor) -> torch.Tensor:
        group.gather(t)
        return t

    cases: list[tuple[str, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = [
        ("broadcast", torch.zeros(64, dtype=torch.int64), group.broadcast)]
    cases += [(f"all_reduce n={n}", torch.randn(n, cfg.hidden_size).to(dtype), group.all_reduce) for n in tokens]
    cases += [(f"gather n={n}", torch.randn(n, -(-cfg.vocab_size // 2)).to(dtype), gather) for n in rows]
    out: dict[str, float] = {}
    for name, t, op in cases:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            op(t)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    if rank == 0:
        results.put(out)


def measure_collectives(cfg: ModelConfig, dtype: torch.dtype, tokens: list[int], rows: list[int],
                        reps: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collectives, args=(r, port, cfg, dtype, tokens, rows, reps, results))
             for r in range(2)]
    for p in procs:
        p.start()
    out: dict[str, float] = results.get(timeout=600)
    for p in procs:
        p.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    ns = parser.parse_args()
    path = shape_checkpoint(ns.shape, parse_overrides(ns.override))
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    runs = {f"TP=1 x{cores}": (1, cores), "TP=1 x1": (1, 1), f"TP=2 x{half}": (2, half)}
    engines = {name: measure_engine(path, tp, threads, ns.batches, ns.prefill, ns.steps)
               for name, (tp, threads) in runs.items()}
    from nanoserve.model import load_model  # the config and dtype the engines ran

    loaded = load_model(path)
    cfg, dtype = loaded.config, loaded.model.dtype
    del loaded
    comm = measure_collectives(cfg, dtype, sorted({1, *ns.batches, ns.prefill}), sorted({1, *ns.batches}), 50)
    print(f"CPU: {cpu}, {cores} cores; {ns.shape} {' '.join(ns.override)} "
          f"({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {str(dtype).removeprefix('torch.')}); "
          "ms per step (xN: torch threads per rank)")
    names = list(runs)
    header = f"{'step':<14}" + "".join(f"{n:>11}" for n in names)
    print(f"wall ms per step\n{header}{'TP2/best TP1':>14}{'collectives':>13}{'of TP=2 step':>14}")
    for step, timing in engines[names[2]].items():
        n = ns.prefill if step == "prefill" else int(step.split("=")[1])
        rows = 1 if step == "prefill" else n  # logits rows: the prefill's last token, one per decode
        collective = ((2 * cfg.num_hidden_layers + 1) * comm[f"all_reduce n={n}"] + comm[f"gather n={rows}"]
                      + 2 * comm["broadcast"])
        best = min(engines[names[0]][step].wall, engines[names[1]][step].wall)
        print(f"{step:<14}" + "".join(f"{engines[name][step].wall * 1e3:>11.1f}" for name in names)
              + f"{timing.wall / best:>14.2f}{collective * 1e3:>13.2f}{collective / timing.wall:>14.0%}")
    print(f"CPU ms per step, all ranks (10 ms clock ticks)\n{header}{'TP2/TP1 x1':>14}")
    for step, timing in engines[names[2]].items():
        print(f"{step:<14}" + "".join(f"{engines[name][step].cpu * 1e3:>11.0f}" for name in names)
              + f"{timing.cpu / engines[names[1]][step].cpu:>14.2f}")
    print("one collective alone (us): " + ", ".join(f"{k} {v * 1e6:.0f}" for k, v in comm.items()))


if __name__ == "__main__":
    main()
