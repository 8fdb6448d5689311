"""Time to first token under each `prefill_order`, in model time: the real scheduler and engine
(the deterministic stand-in model) in a closed loop of C streams, with a step costing
`--step-overhead` + its tokens (a CPU step is compute-bound: every token is a row of every product).

Usage: PYTHONPATH=TREE python scripts/bench_prefill_order.py [--concurrency 64] [--requests 64 128]
           [--prompt 128] [--output 32 32] [--budget 2048] [--step-overhead 8]

For each number of requests N (N = C: one burst; N > C: each finished stream sends the next
request at once, as `bench serve --max-concurrency C` does), prints per order the TTFT p50 and p99
(numpy's percentiles, in token-times), their ratio, the mean, and the total time (throughput).
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import PREFILL_ORDERS
from nanoserve.runtime.stand_in import stand_in_engine


def closed_loop(order: str, streams: int, requests: int, prompt: int, output: tuple[int, int], budget: int,
                overhead: float) -> tuple[list[float], float]:
    """Each request's TTFT and the run's total time, in token-times."""
    engine = stand_in_engine(max_num_seqs=streams, max_num_batched_tokens=budget, max_model_len=prompt + output[1] + 16,
                             prefill_order=order)
    rng = random.Random(0)
    clock, sent, first, next_id = 0.0, {}, {}, 0

    def send() -> None:
        nonlocal next_id
        rid = str(next_id)
        next_id += 1
        engine.add_request(rid, [rng.randrange(1, 1000) for _ in range(prompt)],
                           SamplingParams(max_tokens=rng.randint(*output), temperature=0.0, ignore_eos=True))
        sent[rid] = clock

    while next_id < min(streams, requests):
        send()
    engine.live_stats.record_steps(True)  # each step's composition: its tokens set its cost
    while engine.has_unfinished():
        out = engine.step()
        clock += sum(overhead + s.decode_tokens + s.draft_tokens + s.prefill_tokens
                     for s in engine.live_stats.record().steps)
        for delta in out.deltas:
            first.setdefault(delta.request_id, clock)
        for _ in out.finished:
            if next_id < requests:
                send()
    return [first[r] - sent[r] for r in sent], clock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, nargs=2, default=(32, 32), metavar=("MIN", "MAX"),
                        help="output lengths, uniform in [MIN, MAX]")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--step-overhead", type=float, default=8.0, help="a step's fixed cost, in token-times")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    print(f"C={ns.concurrency}, prompt {ns.prompt}, output {ns.output[0]}-{ns.output[1]}, budget {ns.budget}, "
          f"step = {ns.step_overhead:g} + tokens")
    print(f"{'N':>5} {'order':>7} {'TTFT p50':>9} {'p99':>7} {'p99/p50':>8} {'mean':>7} {'total':>7}")
    for n in ns.requests:
        for order in PREFILL_ORDERS:
            ttft, total = closed_loop(order, ns.concurrency, n, ns.prompt, tuple(ns.output), ns.budget,
                                      ns.step_overhead)
            p50, p99 = np.percentile(ttft, 50), np.percentile(ttft, 99)
            print(f"{n:>5} {order:>7} {p50:>9.0f} {p99:>7.0f} {p99 / p50:>8.2f} {np.mean(ttft):>7.0f} {total:>7.0f}")


if __name__ == "__main__":
    main()
