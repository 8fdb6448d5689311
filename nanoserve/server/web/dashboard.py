"""The live engine dashboard: `GET /dashboard` (the page) and `GET /dashboard/stats` (its data).

The stats stream is Server-Sent Events, one `data: <json>` event per `EngineStats` record the engine
core sends (at most every `engine_core.STATS_INTERVAL_S`), merged with what only the front end
knows: TTFT and ITL percentiles over the last `LATENCY_WINDOW_S` (of at most the latest
`LatencyWindow` samples) and token rates since the previous record. The core builds records only
while at least one stream is open: the first client starts them, the last one to leave stops them
(`AsyncEngine.watch_stats`). Each record is encoded once and handed to every client; a client that
falls `CLIENT_BACKLOG` records behind loses its oldest ones rather than growing a queue. The stream
is behind the API key when one is set (app.py's guard); the page itself carries no data and is
served to anyone. A stream ends when its client goes; at shutdown, an open one is cancelled with the
requests still in flight once the server's graceful-shutdown timeout runs out (uvicorn tells an
application nothing before).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import FileResponse, StreamingResponse

from nanoserve.engine.outputs import EngineStats
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.runtime.metrics import LatencyWindow

PAGE = Path(__file__).parent / "static" / "dashboard.html"
LATENCY_WINDOW_S = 10.0
CLIENT_BACKLOG = 8
# The page loads only its own files and talks only to its own origin.
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class StatsFeed:
    """Fans the engine's stats records out to the open streams, as SSE frames. Lives on the
    event loop. Invariant: the feed watches the engine exactly while `_clients` is not empty."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._clients: set[asyncio.Queue[bytes]] = set()
        self._previous: EngineStats | None = None  # the last record, for rates

    async def events(self) -> AsyncIterator[bytes]:
        """One SSE frame per record, until the consumer stops iterating (the client went)."""
        queue: asyncio.Queue[bytes] = asyncio.Queue(CLIENT_BACKLOG)
        self._clients.add(queue)
        if len(self._clients) == 1:
            self._previous = None
            self._engine.watch_stats(self._on_stats)
        try:
            while True:
                yield await queue.get()
        finally:
            self._clients.discard(queue)
            if not self._clients:
                self._engine.unwatch_stats(self._on_stats)

    def _on_stats(self, stats: EngineStats) -> None:
        frame = b"data: " + json.dumps(self._record(stats), separators=(",", ":")).encode() + b"\n\n"
        self._previous = stats
        for queue in self._clients:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(frame)

    def _record(self, stats: EngineStats) -> dict[str, Any]:
        """The JSON record of one `EngineStats` (the page's only input; see dashboard.js)."""
        snap, kv = stats.snapshot, stats.snapshot.kv
        states = np.frombuffer(stats.block_states, dtype=np.uint8)
        counts = np.bincount(states, minlength=4).tolist()
        rates = None
        previous = self._previous
        if previous is not None and stats.time > previous.time:
            elapsed = stats.time - previous.time
            rates = {"prompt_tps": (snap.prompt_tokens - previous.snapshot.prompt_tokens) / elapsed,
                     "generation_tps": (snap.generation_tokens - previous.snapshot.generation_tokens) / elapsed}
        latencies = self._engine.latencies
        since = time.monotonic() - LATENCY_WINDOW_S
        ttft = itl = None
        if latencies is not None:
            ttft = LatencyWindow.percentiles(latencies.ttft, since)
            itl = LatencyWindow.percentiles(latencies.itl, since)
        return {
            "time": stats.time,
            "blocks": {"block_size": stats.block_size, "states": (states + ord("0")).tobytes().decode("ascii"),
                       "free": counts[0], "used": counts[1], "cached": counts[2], "pinned": counts[3]},
            "tree": {"nodes": stats.tree, "num_nodes": stats.tree_nodes,
                     "queried_tokens": kv.prefix_queried_tokens, "hit_tokens": kv.prefix_hit_tokens,
                     "evicted_blocks": kv.prefix_evicted_blocks},
            "running": [s._asdict() for s in stats.running],
            "waiting": [s._asdict() for s in stats.waiting],
            "num_running": snap.num_running, "num_waiting": snap.num_waiting,
            "num_waiting_seqs": stats.num_waiting_seqs,
            "steps": [list(s) for s in stats.steps],
            "counters": {"prompt_tokens": snap.prompt_tokens, "generation_tokens": snap.generation_tokens,
                         "preemptions": stats.num_preemptions, "drafts_proposed": snap.spec.proposed,
                         "drafts_accepted": snap.spec.accepted},
            "rates": rates,
            "latency": {"window_s": LATENCY_WINDOW_S, "ttft": ttft, "itl": itl},  # [p50, p90, p99] s, or None
            "limits": {"max_num_seqs": stats.max_num_seqs, "max_num_batched_tokens": stats.max_num_batched_tokens},
            "experts": _experts(stats),
        }


def _experts(stats: EngineStats) -> dict[str, Any] | None:
    """A mixture of experts' load for the page (None for a dense model): its shape, the tokens each
    expert received over the record's steps (summed over the MoE layers; None without steps) and
    the engine's counters. Each step of `steps` carries its distinct experts read and its busiest
    expert's tokens (`StepRecord`)."""
    e = stats.snapshot.experts
    if e is None:
        return None
    return {"num_layers": e.num_layers, "num_experts": e.num_experts, "tokens": stats.expert_tokens,
            "steps": e.steps, "expert_reads": e.expert_reads, "expert_read_bytes": e.expert_read_bytes,
            "routed_tokens": e.routed_tokens}


def register_dashboard(app: FastAPI, engine: AsyncEngine) -> StatsFeed:
    """Adds `GET /dashboard` and `GET /dashboard/stats` to `app`; returns the feed behind them."""
    feed = StatsFeed(engine)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(PAGE, media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": PAGE_CSP})

    @app.get("/dashboard/stats", include_in_schema=False)
    async def dashboard_stats() -> StreamingResponse:
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return feed
