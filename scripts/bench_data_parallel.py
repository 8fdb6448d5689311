"""Data parallel against one replica, the same requests: `nanoserve serve --data-parallel-size 2`
(one core each, behind sglang-router) against one replica pinned to one core and to two cores.

Each setup is started, loaded with `nanoserve bench serve` (fixed concurrency, streaming, greedy,
outputs of fixed length), and stopped before the next, so they never share the machine; the
rounds repeat the setups in turn (ABCABC) to spread the machine's drift. The load client runs on
the same cores as the servers (on a 2-core machine it competes with them: the figures are what a
client on the box sees). Prints the machine's CPU, each run, and per setup the median output tok/s,
its ratio to the first setup's, the median TTFT and the prefix-cache hit rate.

Usage: python scripts/bench_data_parallel.py [MODEL] [--rounds 2] [--num-prompts 64] [--concurrency 16]
       [--input-len 64 256] [--output-len 64] [--workload random|shared-prefix] [--setups ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from nanoserve.supervisor.data_parallel import available_cpus, free_port_range
from nanoserve.supervisor.processes import spawn, stop

SETUPS = ("1 replica, 1 core", "1 replica, 2 cores", "DP=2, 1 core each", "DP=2, 1 core each, round robin")


def cpu_name() -> str:
    """The CPU as lscpu names it (its model name), with the cores this process may use."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return f"{names[0] if names else 'unknown CPU'}, {len(available_cpus())} cores available"


@contextmanager
def server(setup: str, model: list[str]) -> Iterator[str]:
    """One setup serving on loopback; yields its URL once it answers (through the router for DP)."""
    cpus = available_cpus()
    if len(cpus) < 2:
        raise SystemExit("this benchmark needs 2 cores")
    port = free_port_range(4)
    serve = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", *model, "--port", str(port),
             "--served-model-name", "bench"]
    no_key = {"NANOSERVE_API_KEY": ""}
    if setup.startswith("DP"):
        policy = "round_robin" if setup.endswith("round robin") else "cache_aware"
        proc = spawn([*serve, "--data-parallel-size", "2", "--router-policy", policy], extra_env=no_key)
    else:
        proc = spawn(serve, tuple(cpus[:1] if "1 core" in setup else cpus[:2]), no_key)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _answers(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{setup} did not start")
            time.sleep(0.5)
        yield url
    finally:
        stop([proc], 60)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def load(url: str, label: str, ns: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One `nanoserve bench serve` run; returns its summary."""
    cmd = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "bench", "serve", "--url", url,
           "--label", label, "--workload", ns.workload, "--num-prompts", str(ns.num_prompts),
           "--max-concurrency", str(ns.concurrency), "--input-len-range", *map(str, ns.input_len),
           "--output-len-range", str(ns.output_len), str(ns.output_len), "--no-roofline", "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "NANOSERVE_API_KEY": ""})
    run: dict[str, Any] = json.loads(out.read_text())["runs"][0]
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="HF folder or .gguf (default: the demo model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=SETUPS[:3], help="what to compare (the first is "
                   "the baseline of the ratios; the DP setups route cache_aware unless named round robin)")
    p.add_argument("--json", type=Path, help="also write every run as JSON")
    ns = p.parse_args()
    print(f"CPU: {cpu_name()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in ns.setups}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for setup in ns.setups:
                with server(setup, [ns.model] if ns.model else []) as url:
                    run = load(url, setup, ns, Path(tmp) / "run.json")
                runs[setup].append(run)
                print(f"round {r + 1}, {setup}: {run['output_tokens_per_s']:.1f} output tok/s, TTFT p50 "
                      f"{run['ttft_ms']['p50']:.0f} ms, {run['completed']} ok / {run['failed']} failed", flush=True)
    base = statistics.median(x["output_tokens_per_s"] for x in runs[ns.setups[0]])
    print(f"\n| setup | output tok/s (median of {ns.rounds}) | vs {ns.setups[0]} | TTFT p50 ms (median) "
          "| prefix hit % |")
    print("|---|---|---|---|---|")
    for setup, xs in runs.items():
        tps = statistics.median(x["output_tokens_per_s"] for x in xs)
        ttft = statistics.median(x["ttft_ms"]["p50"] for x in xs)
        hits = statistics.median(x["prefix_hit_rate"] for x in xs)
        print(f"| {setup} | {tps:.1f} | {tps / base:.2f}x | {ttft:.0f} | {100 * hits:.1f} |")
    if ns.json:
        ns.json.write_text(json.dumps({"cpu": cpu_name(), "args": vars(ns) | {"json": str(ns.json)}, "runs": runs},
                                      indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
