"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure policy: it imports no torch. Each step it spends one token budget
(`max_num_batched_tokens`): first one decode token for every running sequence, then chunks of
unfinished prefills (running ones first, then newly admitted ones, in queue order) until the
budget is used. Admission happens only while the KV manager can supply blocks; when a running
sequence needs a block and none is left even after evicting cached ones, the newest
(lowest-priority) running sequence is preempted: its blocks are cached and freed, its generated
tokens kept, and it goes back to the front of the waiting queue to be recomputed.

The order of prefill chunks (`prefill_order`):
- "fcfs" (the default): each prompt in queue order takes all it can of what the decodes leave,
  so prompts reach their first token in arrival order, one budget's worth of prompt tokens per
  step. This minimises the mean time to first token; under a burst of B equal prompts the times
  spread evenly from one step to the whole burst's prefill (p99 about twice p50).
- "shared" (processor sharing, as in round-robin): what the decodes leave is split into equal
  shares (whole KV blocks, at least one) among the prompts in progress and the waiting ones that
  have seats, and what a prompt needs less than its share goes, in queue order, to those that
  need more. A burst of equal prompts reaches its first tokens together (within one step), and a
  short prompt behind a long one is not held for the whole long prefill; but the burst's earliest
  requests wait as long as its last, and streams of equal lengths then stay in step.
Both spend the same budget per step (no throughput is given up); admission is in queue order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from nanoserve.engine.sequence import Sequence, Status
from nanoserve.kv.manager import KVCacheManager

PREFILL_ORDERS = ("fcfs", "shared")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # or "priority": lower value first, FCFS among equals
    prefill_order: str = "fcfs"  # or "shared": see the module docstring

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose fcfs or priority")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"unknown prefill order {self.prefill_order!r}; choose {' or '.join(PREFILL_ORDERS)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


def _batch_order(item: tuple[Sequence, int]) -> tuple[bool, int]:
    seq, n = item
    return (n > 1, seq.num_computed_tokens if n == 1 else 0)


@dataclass(slots=True)
class StepPlan:
    """Who runs this step and with how many new tokens: a sequence's n new tokens are the first n
    of all_token_ids[num_computed_tokens:] followed by its draft tokens, if it has any.

    Invariant (the batch order, decided here for every plan): `scheduled` lists the single-token
    sequences (decodes) first, shortest context first, then the multi-token ones (prefill chunks,
    decodes with drafts) in the order given. The attention backends take the leading single-token
    sequences as decodes (`AttentionMetadata.num_decodes`) and attend decodes of similar length
    together (torch_ref's chunks), so less of each gather is padding."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.scheduled = sorted(self.scheduled, key=_batch_order)  # stable

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by _order
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def _order(self, seq: Sequence) -> tuple[int, int]:
        return (seq.priority if self.config.policy == "priority" else 0, seq.arrival)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self._order)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}  # insertion-ordered; requests hash by identity
        preempted: list[Sequence] = []
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for r in self.running:
            (decodes if r.num_tokens - r.num_computed_tokens == 1 else prefills).append(r)
        for seq in decodes:
            budget = self._grant(seq, budget, budget, chosen, preempted)
        seats = max(0, self.config.max_num_seqs - len(self.running))
        share = self._share(budget, len(prefills) + min(seats, len(self.waiting)))
        for seq in prefills:
            budget = self._grant(seq, share, budget, chosen, preempted)
        if not preempted:
            budget = self._admit(budget, chosen, share)
            self._top_up(budget, chosen)
        return StepPlan(list(chosen.items()), preempted)

    def _grant(self, seq: Sequence, cap: int, budget: int, chosen: dict[Sequence, int],
               preempted: list[Sequence]) -> int:
        """Schedules up to `cap` of a running sequence's tokens (and drafts) within `budget`,
        preempting the newest running sequences while its blocks cannot be had; returns the
        budget left."""
        if budget == 0 or seq.status is not Status.RUNNING:  # out of budget, or preempted earlier
            return budget
        num_drafts = seq.num_draft_tokens
        n = min(seq.num_tokens - seq.num_computed_tokens + num_drafts, budget, cap)
        if seq.draft is not None and n <= num_drafts:  # the budget cuts the drafts short
            seq.draft = seq.draft.truncate(n - 1) if n > 1 else None
        while not self.kv.allocate(seq.table, seq.num_computed_tokens + n):
            victim = max(self.running, key=self._order)
            budget += chosen.pop(victim, 0)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return budget
        chosen[seq] = n
        return budget - n

    def _share(self, budget: int, contenders: int) -> int:
        """One prompt's share of the prefill budget: all of it in FCFS order; shared: equal among
        `contenders`, in whole KV blocks, at least one block."""
        if self.config.prefill_order == "fcfs" or contenders <= 1:
            return budget
        block = self.kv.block_size
        return max(block, -(-budget // contenders) // block * block)

    def _top_up(self, budget: int, chosen: dict[Sequence, int]) -> None:
        """Gives the budget that shares left over to the chosen prompts still short of their end,
        in the order they were chosen (running, then admitted), while blocks last (never
        preempting for it)."""
        for seq, n in chosen.items():
            if budget == 0:
                return
            more = min(seq.num_tokens - seq.num_computed_tokens - n, budget)
            if seq.num_draft_tokens or more <= 0:
                continue
            if not self.kv.allocate(seq.table, seq.num_computed_tokens + n + more):
                return
            chosen[seq] = n + more
            budget -= more

    def _admit(self, budget: int, chosen: dict[Sequence, int], share: int) -> int:
        """Admits waiting sequences in queue order while budget, seats and blocks last, each with
        a chunk of at most `share` tokens.

        A sequence whose first uncached block is the same (same tokens up to it) as the first
        uncached block of one admitted in this step waits for the next step, where it matches what
        the other computed instead of computing the same prefix beside it (a burst of requests
        with one system prompt computes it once)."""
        computing: set[tuple[int, ...]] = set()  # prompts up to the first block each admission computes
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.wait_for is not None:
                sibling = seq.wait_for
                if not (sibling.finished or sibling.num_computed_tokens >= sibling.num_prompt_tokens):
                    continue
                seq.wait_for = None
            # The table is empty here. Prompt logprobs and mean pooling need every prompt row: no match.
            if not seq.needs_every_prompt_row:
                seq.num_computed_tokens = self.kv.match(seq.table, seq.all_token_ids)
            head = self._first_uncached_block(seq)
            if head is not None and head in computing:
                self.kv.free(seq.table, seq.all_token_ids, 0)
                seq.num_computed_tokens = 0
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, share)
            if not self.kv.allocate(seq.table, seq.num_computed_tokens + n):
                self.kv.free(seq.table, seq.all_token_ids, 0)
                seq.num_computed_tokens = 0
                break
            # Only now, once admitted: a failed attempt's match may be evicted before the next one.
            self.kv.stats.record(seq.num_tokens, seq.num_computed_tokens)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
            if head is not None:
                computing.add(head)
        return budget

    def _first_uncached_block(self, seq: Sequence) -> tuple[int, ...] | None:
        """The tokens up to the end of the first block the sequence computes after its prefix-cache
        match, if that block is full and could be published for others (None without a cache)."""
        if self.kv.cache is None:
            return None
        end = (seq.num_computed_tokens // self.kv.block_size + 1) * self.kv.block_size
        return tuple(seq.all_token_ids[:end]) if end < seq.num_tokens else None

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.table, seq.all_token_ids, seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.draft = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, abort), caching its blocks and releasing them."""
        if seq.finished:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        # A stop inside accepted drafts leaves K/V computed past the last kept token.
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self.kv.free(seq.table, seq.all_token_ids, seq.num_computed_tokens)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def advance(self, plan: StepPlan, rejected: dict[Sequence, int]) -> None:
        """Records that the plan's tokens were computed, less each sequence's rejected drafts
        (whose K/V stays behind as garbage past num_computed_tokens, overwritten later)."""
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n - rejected.get(seq, 0)
            seq.draft = None

    def publish(self, plan: StepPlan) -> None:
        """After the new tokens are appended: publishes newly full blocks to the prefix cache and
        gives back lookahead blocks that rejected drafts no longer need."""
        for seq, _ in plan.scheduled:
            if not seq.finished:
                self.kv.commit(seq.table, seq.all_token_ids, seq.num_computed_tokens)
                self.kv.trim(seq.table, seq.num_tokens)
