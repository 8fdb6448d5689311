"""Prometheus metrics of one server, named `nanoserve:*`, in a registry of their own.

Two writers, both thread-safe through prometheus_client's locks: the engine thread publishes the
engine's state after every iteration (`update_engine`: gauges set, counters advanced by the
change since the previous snapshot), and the event loop records per-request latencies as outputs
arrive (the histograms' `observe`, `record_finished`). `LatencyWindow` keeps the recent samples
themselves, for the dashboard's percentiles over time (event loop only).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from nanoserve.engine.outputs import EngineSnapshot, ExpertStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                    120.0, 240.0, 480.0, 960.0)


class Metrics:
    """Invariant: counters advance with the engine's own monotonic counters (prompt and generated
    tokens, prefix-cache queries and hits), by their change since the previous `update_engine`; an
    engine core started again counts from zero, and its counts are added to those before it. Every
    series carries the served model's name as its `model_name` label (vLLM's convention), so the
    series of several servers can share one Prometheus. A mixture of experts' series
    (`nanoserve:moe_*`) are registered at its first snapshot with expert counters: a dense model
    has none."""

    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        m = self.model_name = model_name
        label = ["model_name"]
        self.running = Gauge("nanoserve:num_requests_running", "Requests in the running batch", label,
                             registry=r).labels(m)
        self.waiting = Gauge("nanoserve:num_requests_waiting", "Requests waiting to be scheduled", label,
                             registry=r).labels(m)
        self.kv_usage = Gauge("nanoserve:kv_cache_usage_perc",
                              "Fraction of KV cache blocks used by live sequences (1 = full)", label,
                              registry=r).labels(m)
        self.prefix_queries = Counter("nanoserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", label, registry=r).labels(m)
        self.prefix_hits = Counter("nanoserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   label, registry=r).labels(m)
        self.prompt_tokens = Counter("nanoserve:prompt_tokens", "Prompt tokens received", label,
                                     registry=r).labels(m)
        self.generation_tokens = Counter("nanoserve:generation_tokens", "Tokens generated", label,
                                         registry=r).labels(m)
        self.engine_restarts = Counter("nanoserve:engine_restarts", "Engine core processes started again after "
                                       "they died", label, registry=r).labels(m)
        self.finished = Counter("nanoserve:request_finished", "Finished requests by finish reason "
                                "(stop, length, abort, error)", ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("nanoserve:time_to_first_token_seconds", "Time from arrival to the first token",
                              label, buckets=_LATENCY_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("nanoserve:inter_token_latency_seconds", "Time between a request's outputs",
                             label, buckets=_LATENCY_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("nanoserve:e2e_request_latency_seconds", "Time from arrival to the last token",
                             label, buckets=_REQUEST_BUCKETS, registry=r).labels(m)
        self.queue_time = Histogram("nanoserve:request_queue_time_seconds", "Time from arrival to scheduling",
                                    label, buckets=_REQUEST_BUCKETS, registry=r).labels(m)
        self.spec_proposed = Counter("nanoserve:spec_decode_num_draft_tokens",
                                     "Draft tokens proposed for verification", label, registry=r).labels(m)
        self.spec_accepted = Counter("nanoserve:spec_decode_num_accepted_tokens",
                                     "Draft tokens the target accepted", label, registry=r).labels(m)
        self.spec_verifications = Counter("nanoserve:spec_decode_num_verifications",
                                          "Sequence steps that verified drafts", label, registry=r).labels(m)
        self.spec_acceptance = Gauge("nanoserve:spec_decode_acceptance_rate",
                                     "Accepted / proposed draft tokens since start", label, registry=r).labels(m)
        self.spec_mean_length = Gauge("nanoserve:spec_decode_mean_accepted_length",
                                      "Tokens per verification (accepted drafts + 1) since start", label,
                                      registry=r).labels(m)
        self._mirrored = (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits,
                          self.spec_proposed, self.spec_accepted, self.spec_verifications)
        self._last = (0,) * len(self._mirrored)
        self._experts: _ExpertMetrics | None = None

    def update_engine(self, snap: EngineSnapshot) -> None:
        """Engine thread only: publishes the engine's state after one loop iteration."""
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv.blocks_used / snap.kv.blocks_total if snap.kv.blocks_total else 0.0)
        kv = snap.kv
        spec = snap.spec
        now = (snap.prompt_tokens, snap.generation_tokens, kv.prefix_queried_tokens, kv.prefix_hit_tokens,
               spec.proposed, spec.accepted, spec.verifications)
        self.spec_acceptance.set(spec.acceptance_rate)
        self.spec_mean_length.set(spec.mean_accepted_length)
        for counter, new, old in zip(self._mirrored, now, self._last, strict=True):
            counter.inc(new - old if new >= old else new)  # an engine restarted counts from zero again
        self._last = now
        if snap.experts is not None:
            if self._experts is None:
                self._experts = _ExpertMetrics(self.registry, self.model_name)
            self._experts.update(snap.experts)

    def record_finished(self, reason: str, e2e_s: float | None) -> None:
        self.finished.labels(self.model_name, reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition in the format the scraper's Accept header asks for (Prometheus text by
        default, OpenMetrics on request), and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class _ExpertMetrics:
    """A mixture of experts' load (`ExpertStats`): counters that advance as the engine's do (an
    engine started again counts from zero), and the latest step's figures as gauges."""

    def __init__(self, r: CollectorRegistry, m: str) -> None:
        label = ["model_name"]
        self.steps = Counter("nanoserve:moe_steps", "Steps that ran the mixture-of-experts layers", label,
                             registry=r).labels(m)
        self.reads = Counter("nanoserve:moe_expert_reads", "Distinct experts chosen per step and MoE layer, summed "
                             "(each expert's matrices streamed once)", label, registry=r).labels(m)
        self.read_bytes = Counter("nanoserve:moe_expert_read_bytes", "Weight bytes of the experts read", label,
                                  registry=r).labels(m)
        self.routed = Counter("nanoserve:moe_routed_tokens", "(token, expert) choices summed over MoE layers", label,
                              registry=r).labels(m)
        self.read_per_layer = Gauge("nanoserve:moe_experts_read_per_layer", "Distinct experts read in the latest "
                                    "step, mean over MoE layers", label, registry=r).labels(m)
        self.busiest_share = Gauge("nanoserve:moe_busiest_expert_share", "Largest fraction of the latest step's "
                                   "tokens that one expert of one layer received", label, registry=r).labels(m)
        self._mirrored = (self.steps, self.reads, self.read_bytes, self.routed)
        self._last = (0,) * len(self._mirrored)

    def update(self, stats: ExpertStats) -> None:
        now = (stats.steps, stats.expert_reads, stats.expert_read_bytes, stats.routed_tokens)
        for counter, new, old in zip(self._mirrored, now, self._last, strict=True):
            counter.inc(new - old if new >= old else new)
        self._last = now
        self.read_per_layer.set(stats.last_experts_read / stats.num_layers)
        self.busiest_share.set(stats.last_busiest_share)


class LatencyWindow:
    """The latest TTFT and ITL samples as (time.monotonic when observed, seconds), each kind
    bounded to `max_samples` (the oldest go first), for percentiles over a recent window."""

    def __init__(self, max_samples: int = 4096) -> None:
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.itl: deque[tuple[float, float]] = deque(maxlen=max_samples)

    @staticmethod
    def percentiles(samples: deque[tuple[float, float]], since: float,
                    qs: tuple[float, ...] = (50, 90, 99)) -> list[float] | None:
        """The `qs` percentiles of the samples observed at or after `since`; None if none was.
        Samples arrive in time order, so only the recent ones are read."""
        recent = [v for _, v in itertools.takewhile(lambda s: s[0] >= since, reversed(samples))]
        return [float(x) for x in np.percentile(recent, qs)] if recent else None
