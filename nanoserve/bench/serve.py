"""`nanoserve bench serve`: an async load client for any OpenAI-compatible server.

Requests stream (`stream: true` with `include_usage`) to /v1/completions or /v1/chat/completions,
greedy, with `max_tokens` = `min_tokens` = the request's output length and `ignore_eos` (vLLM's
extras; a server without them may stop early, and the counts below are what it actually sent).
Load is either a fixed number of requests in flight (`max_concurrency`) or Poisson arrivals at
`request_rate` per second (optionally also capped by `max_concurrency`); for multi-turn
conversations the rate is of conversation starts and each later turn is sent when the previous
reply has arrived. One short request warms the server up before the clock starts.

Measured per request, on the client's clock:
- TTFT: from sending to the first chunk that carries text (with `every_chunk`, the first chunk
  with a choice that does not finish it: a server that streams one chunk per token, even a token
  whose text is empty, as llama-server does for a random-weight model's padding ids);
- ITL: the gaps between successive such chunks;
- TPOT: (E2E - TTFT) / (output tokens - 1);
- E2E: from sending to the end of the stream;
- prompt, output and cached prompt tokens from the server's usage (else counted locally).
A run reports completed and failed requests, requests/s, output and total tokens/s over its
duration, mean/p50/p90/p99 of each latency, and the prefix-cache hit rate (cached / prompt tokens).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from nanoserve.bench.throughput import format_table
from nanoserve.bench.workloads import Conversation

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    label: str
    model: str | None = None  # default: the first model the server lists
    endpoint: str = "completions"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 1800.0
    every_chunk: bool = False  # time every token chunk, not only those with text (see above)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def summarize(values: list[float]) -> dict[str, float]:
    """mean, p50, p90 and p99 in milliseconds (zeros when empty)."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


@dataclass(slots=True)
class LoadReport:
    """The results of one run (one concurrency or one rate) against one server."""

    config: LoadConfig
    duration_s: float
    results: list[RequestResult]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        prompt, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
        d = self.duration_s or math.inf
        lat = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
               "itl": [x for r in ok for x in r.itl], "e2e": [r.e2e for r in ok]}
        return {
            "label": self.config.label, "max_concurrency": self.config.max_concurrency,
            "request_rate": self.config.request_rate, "completed": len(ok), "failed": len(self.results) - len(ok),
            "duration_s": self.duration_s, "requests_per_s": len(ok) / d, "output_tokens_per_s": out / d,
            "total_tokens_per_s": (prompt + out) / d, "prompt_tokens": prompt, "output_tokens": out,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            **{f"{k}_ms": summarize(v) for k, v in lat.items()},
            "errors": sorted({r.error for r in self.results if not r.ok})[:5],
        }


def _body(cfg: LoadConfig, model: str, conv: Conversation, turn: int, replies: list[str]) -> dict[str, Any]:
    n = conv.output_lens[turn]
    body: dict[str, Any] = {"model": model, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
                            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = conv.messages(turn, replies)
    elif conv.prompt_ids is not None:
        body["prompt"] = list(conv.prompt_ids)
    else:
        body["prompt"] = conv.prompt(turn, replies)
    return body


async def sse_lines(r: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split at line feeds only (a trailing carriage return dropped), as the
    format has them. httpx's aiter_lines also splits at U+2028, U+2029, U+0085 and the like, which a
    server may leave raw inside an event's JSON string, and would cut the event in two."""
    partial = b""
    async for data in r.aiter_bytes():
        *lines, partial = (partial + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if partial:
        yield partial.rstrip(b"\r").decode()


async def send(client: httpx.AsyncClient, cfg: LoadConfig, body: dict[str, Any],
               count: Callable[[str], int]) -> RequestResult:
    """Streams one request and times it; `count` counts tokens when the server sends no usage."""
    res, usage = RequestResult(), None
    pieces: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[cfg.endpoint], json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            async for line in sse_lines(r):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    return res
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece or (cfg.every_chunk and piece is not None and choice.get("finish_reason") is None):
                        now = time.perf_counter()
                        if pieces:
                            res.itl.append(now - last)
                        else:
                            res.ttft = now - start
                        last = now
                        pieces.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e = time.perf_counter() - start
    res.text = "".join(pieces)
    if not pieces:
        res.ttft = res.e2e
    if usage:
        res.prompt_tokens, res.output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        prompt = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        res.prompt_tokens, res.output_tokens = count(prompt), count(res.text)
    res.ok = True
    return res


async def wait_ready(client: httpx.AsyncClient, timeout_s: float) -> None:
    """Waits while /health answers 503 (a server still loading its model); a server without
    /health (404) counts as ready."""
    deadline = time.monotonic() + timeout_s
    while (await client.get("/health")).status_code == 503:
        if time.monotonic() > deadline:
            raise RuntimeError("the server was still loading its model at the timeout")
        await asyncio.sleep(0.5)


async def served_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_load(cfg: LoadConfig, conversations: list[Conversation], count: Callable[[str], int]) -> LoadReport:
    """Runs every conversation against the server under the configured load."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency or len(conversations) + 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        await wait_ready(client, cfg.timeout_s)
        model = cfg.model or await served_model(client)
        warm = await send(client, cfg, _body(cfg, model, Conversation(("Hello",), (2,)), 0, []), count)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request to {cfg.url} failed: {warm.error}")
        gate = asyncio.Semaphore(cfg.max_concurrency or len(conversations))
        results: list[RequestResult] = []

        async def converse(conv: Conversation) -> None:
            replies: list[str] = []
            for turn in range(len(conv.user_turns)):
                async with gate:
                    res = await send(client, cfg, _body(cfg, model, conv, turn, replies), count)
                results.append(res)
                if not res.ok:
                    return
                replies.append(res.text)

        rng = random.Random(cfg.seed)
        start = time.perf_counter()
        tasks = []
        for i, conv in enumerate(conversations):
            if i and math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(converse(conv)))
        await asyncio.gather(*tasks)
        return LoadReport(cfg, time.perf_counter() - start, results)


def peer_summary(run: Any, peer: str, batch: int) -> dict[str, Any]:
    """A peer's offline run (`RunStats`) in the shape of a server summary. Its latencies count
    from when the peer was handed the request (a static batch: from the batch's start)."""
    first, last = zip(*run.latencies, strict=True) if run.latencies else ((), ())
    return {"label": run.label, "peer": peer, "batch": batch, "completed": run.requests, "failed": 0,
            "duration_s": run.elapsed_s, "requests_per_s": run.requests_per_s,
            "output_tokens_per_s": run.output_tokens_per_s, "total_tokens_per_s": run.total_tokens_per_s,
            "prefill_tokens_per_s": run.prefill_tokens_per_s, "decode_tokens_per_s": run.decode_tokens_per_s,
            "ttft_ms": summarize(list(first)), "e2e_ms": summarize(list(last)), "latencies": run.latencies}


def format_summaries(runs: list[dict[str, Any]], peers: list[dict[str, Any]]) -> str:
    """A throughput table (servers, then peers) and a latency table (servers), then the ratio of
    the best server run's output tok/s to each peer's."""
    def rate(r: dict[str, Any]) -> str:
        return "inf" if math.isinf(r.get("request_rate", math.inf)) else f"{r['request_rate']:g}"

    headers = ["run", "concurrency", "rate/s", "completed", "failed", "requests/s", "output tok/s",
               "total tok/s", "prefix hit %", "duration s"]
    rows = [[r["label"], str(r["max_concurrency"] or "-"), rate(r), str(r["completed"]), str(r["failed"]),
             f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}", f"{r['total_tokens_per_s']:.1f}",
             f"{100 * r['prefix_hit_rate']:.1f}", f"{r['duration_s']:.1f}"] for r in runs]
    rows += [[p["label"], f"(batch {p['batch']})", "-", str(p["completed"]), "0", f"{p['requests_per_s']:.2f}",
              f"{p['output_tokens_per_s']:.1f}", f"{p['total_tokens_per_s']:.1f}", "-", f"{p['duration_s']:.1f}"]
             for p in peers]
    lines = [format_table(headers, rows), ""]
    lines += [f"{r['label']} c={r['max_concurrency'] or '-'}: prefix cache hit rate {100 * r['prefix_hit_rate']:.1f}% "
              f"of prompt tokens; shared fraction {100 * r['shared_fraction']:.1f}%, so "
              f"{100 * r['prefix_hit_rate'] / r['shared_fraction']:.0f}% of what is shareable"
              for r in runs if r.get("shared_fraction")]
    lines.append("")
    headers = ["run (ms)", *[f"{k} {s}" for k in LATENCIES for s in ("mean", "p50", "p90", "p99")]]
    rows = [[f"{r['label']} c={r['max_concurrency'] or '-'} r={rate(r)}",
             *[f"{r[f'{k}_ms'][s]:.1f}" for k in LATENCIES for s in ("mean", "p50", "p90", "p99")]] for r in runs]
    lines.append(format_table(headers, rows))
    errors = sorted({e for r in runs for e in r.get("errors", [])})
    lines += [f"error: {e}" for e in errors]
    if runs and peers:
        lines.append("")
        for p in peers:
            # Batched peers against the same server run at the same concurrency; one-at-a-time peers
            # against the server's best run.
            same = [r for r in runs if r["label"] == runs[0]["label"] and r["max_concurrency"] == p["batch"]]
            r = same[0] if same and p["batch"] > 1 else max(runs, key=lambda r: r["output_tokens_per_s"])
            if p["output_tokens_per_s"]:
                lines.append(f"{r['label']} (c={r['max_concurrency'] or '-'}) / {p['label']} output tok/s: "
                             f"{r['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}x")
    return "\n".join(lines)
