"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure policy: it imports no torch. Each step it spends one token budget
(`max_num_batched_tokens`): first one decode token for every running sequence, then chunks of
unfinished prefills (running ones first, then newly admitted ones) until the budget is used.
Admission happens only while the KV manager can supply blocks; when a running sequence needs a
block and none is left even after evicting cached ones, the newest (lowest-priority) running
sequence is preempted: its blocks are cached and freed, its generated tokens kept, and it goes
back to the front of the waiting queue to be recomputed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from nanoserve.engine.request import Request, Status
from nanoserve.kv.manager import KVCacheManager


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # or "priority": lower value first, FCFS among equals

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose fcfs or priority")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


def _batch_order(item: tuple[Request, int]) -> tuple[bool, int]:
    req, n = item
    return (n > 1, req.num_computed_tokens if n == 1 else 0)


@dataclass(slots=True)
class StepPlan:
    """Who runs this step and with how many new tokens: a sequence's n new tokens are the first n
    of all_token_ids[num_computed_tokens:] followed by its draft tokens, if it has any.

    Invariant (the batch order, decided here for every plan): `scheduled` lists the single-token
    sequences (decodes) first, shortest context first, then the multi-token ones (prefill chunks,
    decodes with drafts) in the order given. The attention backends take the leading single-token
    sequences as decodes (`AttentionMetadata.num_decodes`) and attend decodes of similar length
    together (torch_ref's chunks), so less of each gather is padding."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scheduled = sorted(self.scheduled, key=_batch_order)  # stable

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by _order
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def _order(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.config.policy == "priority" else 0, req.arrival)

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        bisect.insort(self.waiting, req, key=self._order)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Request, int] = {}  # insertion-ordered; requests hash by identity
        preempted: list[Request] = []
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_drafts = req.num_draft_tokens
            n = min(req.num_tokens - req.num_computed_tokens + num_drafts, budget)
            if req.draft is not None and n <= num_drafts:  # the budget cuts the drafts short
                req.draft = req.draft.truncate(n - 1) if n > 1 else None
            while not self.kv.allocate(req.table, req.num_computed_tokens + n):
                victim = max(self.running, key=self._order)
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                chosen[req] = n
                budget -= n
        if not preempted:
            budget = self._admit(budget, chosen)
        return StepPlan(list(chosen.items()), preempted)

    def _admit(self, budget: int, chosen: dict[Request, int]) -> int:
        """Admits waiting sequences in queue order while budget, seats and blocks last.

        A sequence whose first uncached block is the same (same tokens up to it) as the first
        uncached block of one admitted in this step waits for the next step, where it matches what
        the other computed instead of computing the same prefix beside it (a burst of requests
        with one system prompt computes it once)."""
        computing: set[tuple[int, ...]] = set()  # prompts up to the first block each admission computes
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.wait_for is not None:
                sibling = req.wait_for
                if not (sibling.finished or sibling.num_computed_tokens >= sibling.num_prompt_tokens):
                    continue
                req.wait_for = None
            req.num_computed_tokens = self.kv.match(req.table, req.all_token_ids)  # the table is empty here
            head = self._first_uncached_block(req)
            if head is not None and head in computing:
                self.kv.free(req.table, req.all_token_ids, 0)
                req.num_computed_tokens = 0
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req.table, req.num_computed_tokens + n):
                self.kv.free(req.table, req.all_token_ids, 0)
                req.num_computed_tokens = 0
                break
            # Only now, once admitted: a failed attempt's match may be evicted before the next one.
            self.kv.stats.record(req.num_tokens, req.num_computed_tokens)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            chosen[req] = n
            budget -= n
            if head is not None:
                computing.add(head)
        return budget

    def _first_uncached_block(self, req: Request) -> tuple[int, ...] | None:
        """The tokens up to the end of the first block the sequence computes after its prefix-cache
        match, if that block is full and could be published for others (None without a cache)."""
        if self.kv.cache is None:
            return None
        end = (req.num_computed_tokens // self.kv.block_size + 1) * self.kv.block_size
        return tuple(req.all_token_ids[:end]) if end < req.num_tokens else None

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.table, req.all_token_ids, req.num_computed_tokens)
        req.num_computed_tokens = 0
        req.draft = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.add(req)

    def finish(self, req: Request, reason: str) -> None:
        """Ends a sequence (stop, length, abort), caching its blocks and releasing them."""
        if req.finished:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        # A stop inside accepted drafts leaves K/V computed past the last kept token.
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        self.kv.free(req.table, req.all_token_ids, req.num_computed_tokens)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def advance(self, plan: StepPlan, rejected: dict[Request, int]) -> None:
        """Records that the plan's tokens were computed, less each sequence's rejected drafts
        (whose K/V stays behind as garbage past num_computed_tokens, overwritten later)."""
        for req, n in plan.scheduled:
            req.num_computed_tokens += n - rejected.get(req, 0)
            req.draft = None

    def publish(self, plan: StepPlan) -> None:
        """After the new tokens are appended: publishes newly full blocks to the prefix cache and
        gives back lookahead blocks that rejected drafts no longer need."""
        for req, _ in plan.scheduled:
            if not req.finished:
                self.kv.commit(req.table, req.all_token_ids, req.num_computed_tokens)
                self.kv.trim(req.table, req.num_tokens)
