"""Startup time (issue #31): from launching `nanoserve serve MODEL` to its first /health 200, warm.

Usage: PYTHONPATH=. python scripts/bench_startup.py [--model demo|llama-3.2-1b-q8_0|PATH] [--runs 5]
       [--port 18400] [--tree CHECKOUT ...] [--serve-arg=--flag ...]

Warm means: the model's files are in the page cache, its checkpoint (and GGUF) already made, the
CPU kernels already built (at install). One untimed run makes it so, then `--runs` timed runs each
launch `python -m nanoserve.cli serve MODEL --port P` with PYTHONPATH=TREE, poll /health every 50 ms,
and stop the server with SIGINT. Given several `--tree`s (a checkout before a change and one after),
the runs alternate between them, so that both meet the same load. Each run also reads the time
stamps of the server's own log lines, so the result says where the time goes: `stages_s` holds,
for the median run, the seconds from launch to the first line (the CLI's imports), to the line
saying the model has loaded (the engine-core process spawned, torch imported there, the weights
loaded), to the KV cache line (the pool allocated), and to healthy (warm-up and the first /health).
`import_s` times `import torch` and `import nanoserve.cli` in fresh interpreters for comparison.

`--model llama-3.2-1b-q8_0`: a Llama-3.2-1B-shaped checkpoint with random weights
(`nanoserve.bench.shapes`), exported once to a Q8_0 GGUF (`peers.gguf_for`), both cached under
$NANOSERVE_CACHE. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

# The server's log lines that end a stage, by the words they contain.
STAGES = (("cli_imported", "serving "), ("model_loaded", " loaded "), ("kv_pool_built", "KV cache:"))


def model_argument(name: str) -> str:
    """What `nanoserve serve` is given for `name`: nothing for the demo, a cached 1B GGUF, or a path."""
    if name == "demo":
        return ""
    if name == "llama-3.2-1b-q8_0":
        from nanoserve.bench.peers import gguf_for
        from nanoserve.bench.shapes import shape_checkpoint

        return str(gguf_for(shape_checkpoint("llama-3.2-1b"), "Q8_0"))
    return name


def logged_at(line: str, launched: float) -> float | None:
    """Seconds from `launched` (time.time()) to the time stamp that starts a log line, if it has one
    (the line's own stamp, not when this process got to read it)."""
    try:
        stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    except ValueError:
        return None
    return stamp.timestamp() - launched


def one_run(tree: str, model: str, port: int, serve_args: list[str]) -> dict[str, Any]:
    """Launches the server of the checkout at `tree`, waits for /health 200, stops it; the seconds
    to healthy and to each stage's log line (None for a line that never came)."""
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", *([model] if model else []), "--port", str(port),
           *serve_args]
    started, launched = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env={**os.environ, "PYTHONPATH": tree})
    seen: dict[str, float] = {}

    def read_log() -> None:
        assert proc.stdout is not None
        for text in proc.stdout:
            for line in text.split("\r"):  # a progress bar's redraws share a line with the next record
                for stage, words in STAGES:
                    if stage not in seen and words in line and '"GET /health' not in line:
                        seen[stage] = logged_at(line, launched) or time.monotonic() - started

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    healthy = time.monotonic() - started
                    break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    return {"healthy": healthy, **{stage: seen.get(stage) for stage, _ in STAGES}}


def import_seconds(tree: str, statement: str) -> float:
    """Seconds a fresh interpreter takes to run `statement` (an import), less an empty one's start."""
    def timed(code: str) -> float:
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": tree})
        return time.monotonic() - t

    timed(statement)  # warm the page cache
    return round(timed(statement) - timed("pass"), 2)


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's machine string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median, min and max seconds to healthy, and the stages of the median run."""
    runs = sorted(runs, key=lambda r: r["healthy"])
    healthy = [r["healthy"] for r in runs]
    return {"healthy_s": {"median": round(statistics.median(healthy), 2), "min": round(min(healthy), 2),
                          "max": round(max(healthy), 2)},
            "stages_s": {k: None if v is None else round(v, 2) for k, v in runs[len(runs) // 2].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--tree", action="append", default=[],
                        help="a checkout to serve from (repeatable: runs alternate between them; default: this one)")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more flag for `serve` (repeatable)")
    args = parser.parse_args()
    trees = args.tree or [str(Path(__file__).resolve().parents[1])]
    model = model_argument(args.model)
    runs: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for tree in trees:
        one_run(tree, model, args.port, args.serve_arg)  # warm-up, untimed
    for i in range(args.runs):
        for tree in trees:
            runs[tree].append(one_run(tree, model, args.port, args.serve_arg))
            print(f"run {i + 1}, {tree}: healthy after {runs[tree][-1]['healthy']:.2f} s", file=sys.stderr, flush=True)
    print(json.dumps({
        "model": args.model, "file": model or "demo", "runs": args.runs,
        "trees": {tree: {**summary(runs[tree]), "import_s": {
            "torch": import_seconds(tree, "import torch"),
            "nanoserve.cli": import_seconds(tree, "import nanoserve.cli")}} for tree in trees},
        "cpu": cpu_name(), "cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
