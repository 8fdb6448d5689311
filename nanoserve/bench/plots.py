"""PNG plots of `bench serve` sweeps (matplotlib, imported only when plotting).

- `plot_throughput`: output tokens/s against concurrency, one line per server, plus the peers:
  static batches and transformers' continuous batching at their batch sizes, one-at-a-time peers
  as points at concurrency 1.
- `plot_ttft`: median TTFT against request rate, one line per server. For the one-at-a-time peers
  the curve is computed, not measured under load: the same Poisson arrivals served first come first
  served by a server that runs one request at a time, each taking the time measured for it alone
  (an M/G/1 queue over measured service times).

Inputs are the dictionaries `bench serve` writes to JSON: server run summaries (label,
max_concurrency, request_rate, output_tokens_per_s, ttft_ms) and peer runs (label, peer, batch,
output_tokens_per_s, latencies).
"""

from __future__ import annotations

import random
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """The arrival times `bench serve` uses for `n` requests at `rate` per second (the first at 0)."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def one_at_a_time_ttfts(arrivals: list[float], service: list[tuple[float, float]]) -> list[float]:
    """TTFTs of a server that runs one request at a time, first come first served, given the
    arrival times and each request's (time to first token, total time) when served alone."""
    free_at, out = 0.0, []
    for arrival, (first, total) in zip(arrivals, service, strict=True):
        begin = max(arrival, free_at)
        out.append(begin + first - arrival)
        free_at = begin + total
    return out


def plot_throughput(runs: list[dict[str, Any]], peers: list[dict[str, Any]], path: Path, title: str) -> None:
    """Output tokens/s against max concurrency; peers at their batch sizes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        series[r["label"]].append((r["max_concurrency"], r["output_tokens_per_s"]))
    for p in peers:
        series[p["peer"]].append((p["batch"], p["output_tokens_per_s"]))
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", linestyle="-" if len(xs) > 1 else "none", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("concurrent requests (peers: batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft(runs: list[dict[str, Any]], peers: list[dict[str, Any]], path: Path, title: str, seed: int) -> None:
    """Median TTFT against request rate; one-at-a-time peers through the queue model above."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        series[r["label"]].append((r["request_rate"], r["ttft_ms"]["p50"]))
    requests = {r["request_rate"]: r["completed"] + r["failed"] for r in runs}
    for p in peers:
        if p["batch"] != 1:
            continue
        for rate, n in sorted(requests.items()):
            service = [tuple(p["latencies"][i % len(p["latencies"])]) for i in range(n)]  # measured, reused in turn
            ttfts = one_at_a_time_ttfts(poisson_arrivals(n, rate, seed), service)
            series[f"{p['peer']} (queue model)"].append((rate, 1000 * statistics.median(ttfts)))
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", linestyle="--" if "queue model" in label else "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(requests)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
