"""The engine's insides for a live view (the dashboard): the composition of each step while someone
watches, and on demand an `EngineStats` record read from the scheduler and the KV manager.

Invariants: off (the default) a step spends nothing here but one test of `recording`; each recorded
step appears in exactly one record (a record takes the steps recorded since the previous one, at
most `STEP_RING` of them, the newest); reading a record changes nothing of the engine's state.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.engine.expert_load import StepExperts
from nanoserve.engine.outputs import EngineSnapshot, EngineStats, SequenceStats, StepRecord
from nanoserve.engine.scheduler import Scheduler, StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.manager import KVCacheManager

STEP_RING = 256  # steps kept between two records
STATS_MAX_TREE_NODES = 512
STATS_MAX_SEQS = 256  # of each queue


class StepStart(NamedTuple):
    """What a recorded step knew before it ran: its start time and its (decode, draft, prefill)
    tokens, read before the step advances the plan's sequences."""

    time: float
    decode_tokens: int
    draft_tokens: int
    prefill_tokens: int


class LiveStats:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._scheduler = scheduler
        self._kv = kv
        self._snapshot = snapshot
        self._steps: collections.deque[StepRecord] | None = None
        self._expert_tokens: torch.Tensor | None = None  # per expert, over the steps since the last record

    @property
    def recording(self) -> bool:
        return self._steps is not None

    def record_steps(self, on: bool) -> None:
        """Starts (or stops and forgets) recording each step's composition."""
        if on != self.recording:
            self._steps = collections.deque(maxlen=STEP_RING) if on else None
            self._expert_tokens = None

    def now(self) -> float | None:
        """The time a step starts (before it is scheduled), or None while not recording."""
        return None if self._steps is None else time.monotonic()

    def step_started(self, plan: StepPlan, started: float | None) -> StepStart | None:
        """The start of a step that began at `started` (`now()`) and runs `plan`, or None while not
        recording. A sequence with one uncomputed token decodes (plus its drafts); any other
        computes a prompt chunk."""
        if started is None:
            return None
        decode = drafts = prefill = 0
        for seq, n in plan.scheduled:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                decode += 1
                drafts += n - 1
            else:
                prefill += n
        return StepStart(started, decode, drafts, prefill)

    def step_ended(self, start: StepStart | None, plan: StepPlan, experts: StepExperts | None = None) -> None:
        """Records a step that `step_started` began; `experts`: its expert load (a mixture of
        experts' step), added to the tokens per expert of the next record."""
        if start is None or self._steps is None:
            return
        end = time.monotonic()
        self._steps.append(StepRecord(
            end=end, duration_s=end - start.time, num_seqs=len(plan.scheduled), decode_tokens=start.decode_tokens,
            draft_tokens=start.draft_tokens, prefill_tokens=start.prefill_tokens,
            budget=self._scheduler.config.max_num_batched_tokens, preempted=len(plan.preempted),
            experts_read=0 if experts is None else experts.experts_read,
            busiest_expert_tokens=0 if experts is None else experts.busiest_tokens))
        if experts is not None:
            tokens = experts.tokens_per_expert
            self._expert_tokens = tokens.clone() if self._expert_tokens is None else self._expert_tokens + tokens

    def record(self) -> EngineStats:
        """A record of the engine now (see `EngineStats`), taking the steps recorded since the
        previous one. Reads the block pool's reference counts vectorised, the running sequences'
        tables and locked paths, the tree's first nodes and the listed sequences: meant to be built
        a few times a second at most, only while someone watches."""
        cache = self._kv.cache
        walk = cache.walk(STATS_MAX_TREE_NODES) if cache is not None else []
        steps: list[StepRecord] = []
        if self._steps is not None:
            steps = list(self._steps)
            self._steps.clear()
        expert_tokens, self._expert_tokens = self._expert_tokens, None
        scheduler = self._scheduler
        running, waiting = scheduler.running, scheduler.waiting
        return EngineStats(
            time=time.monotonic(),
            block_size=self._kv.block_size,
            block_states=self._kv.block_states(s.table for s in running).tobytes(),
            tree=[(parent, len(node.blocks), node.lock_ref > 0) for node, parent in walk],
            tree_nodes=cache.num_nodes if cache is not None else 0,
            running=[_sequence_stats(s) for s in running[:STATS_MAX_SEQS]],
            waiting=[_sequence_stats(s) for s in waiting[:STATS_MAX_SEQS]],
            num_waiting_seqs=len(waiting),
            steps=steps,
            snapshot=self._snapshot(),
            num_preemptions=scheduler.num_preemptions,
            max_num_seqs=scheduler.config.max_num_seqs,
            max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
            expert_tokens=None if expert_tokens is None else expert_tokens.tolist(),
        )


def _sequence_stats(seq: Sequence) -> SequenceStats:
    return SequenceStats(
        request_id=seq.request_id, seq_index=seq.index, prompt_tokens=seq.num_prompt_tokens,
        computed_tokens=seq.num_computed_tokens, output_tokens=seq.num_output_tokens,
        max_tokens=seq.params.max_tokens, cached_tokens=seq.num_cached_tokens, preemptions=seq.num_preemptions,
        drafts_proposed=seq.num_drafts_proposed, drafts_accepted=seq.num_drafts_accepted)
