"""Time to a 429 under a flood (issue #28): prints one JSON line.

Usage: PYTHONPATH=TREE python scripts/bench_overload.py [--tree TREE] [--port 18320] [--requests 1000]

Serves the demo model with `nanoserve serve --max-num-seqs 4 --max-queued-requests 8` from TREE
(default: this checkout), then opens `--requests` connections at once, each sending one chat
completion (`max_tokens` 32), and records when each answer's status line arrives, counted from
just before its connection was opened. The client writes prebuilt requests on raw sockets from one
event loop, so what it measures is the server's answer time plus the wait for the loop, not an HTTP
client's own work. Prints the statuses and the p50/p99/max seconds to a 429 (and to a 200). Run it
on two trees to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from served import wait_healthy


def request_bytes(port: int) -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story about a fox."}],
                       "max_tokens": 32, "ignore_eos": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


async def one(port: int, payload: bytes, results: list[tuple[int, float]]) -> None:
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)
        line = await reader.readline()
        status = int(line.split()[1]) if line else -1
    except (OSError, IndexError, ValueError):
        status = -1
        writer = None
    results.append((status, time.monotonic() - start))
    if writer is not None:
        writer.close()


async def flood(port: int, n: int) -> list[tuple[int, float]]:
    results: list[tuple[int, float]] = []
    payload = request_bytes(port)
    await asyncio.gather(*(one(port, payload, results) for _ in range(n)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--port", type=int, default=18320)
    parser.add_argument("--requests", type=int, default=1000)
    ns = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": ns.tree}
    cli = [sys.executable, "-m", "nanoserve.cli", "--log-level", "ERROR", "serve"]
    flags = ["--port", str(ns.port), "--max-num-seqs", "4", "--max-queued-requests", "8"]
    help_text = subprocess.run([*cli, "--help"], env=env, cwd=ns.tree, capture_output=True, text=True,
                               check=True).stdout
    if "--max-connections" in help_text:  # a tree that caps connections: room for the whole flood
        flags += ["--max-connections", str(ns.requests + 64)]
    url = f"http://127.0.0.1:{ns.port}"
    server = subprocess.Popen([*cli, *flags], env=env, cwd=ns.tree)
    try:
        wait_healthy(url, server)
        results = asyncio.run(flood(ns.port, ns.requests))
    finally:
        server.terminate()
        server.wait(30)
    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    report: dict[str, object] = {"tree": ns.tree, "requests": ns.requests, "statuses": statuses}
    for status in (429, 200):
        times = [t for s, t in results if s == status]
        if times:
            report[f"to_{status}_s"] = {"p50": round(statistics.median(times), 3),
                                        "p99": round(percentile(times, 0.99), 3), "max": round(max(times), 3)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
