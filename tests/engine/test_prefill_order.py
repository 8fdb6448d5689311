"""The order of prefill chunks, on the pure scheduler alone (no model): a burst of equal prompts
under both `prefill_order`s, a short prompt behind a long one, and what neither may give up
(every decode keeps its token, admission in queue order, the whole budget spent while prompts
wait). Each step is played as the engine plays it: schedule, advance, one token appended to every
sequence whose prompt is done, sequences ended at their output length."""

from __future__ import annotations

import pytest

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.sequence import Sequence
from nanoserve.kv.manager import KVCacheManager

BLOCK = 16


def _scheduler(order: str, budget: int, seats: int = 64, blocks: int = 4096) -> Scheduler:
    return Scheduler(SchedulerConfig(seats, budget, prefill_order=order), KVCacheManager(blocks, BLOCK))


def _add(sch: Scheduler, name: str, prompt_len: int, output_len: int, arrival: int) -> Sequence:
    seq = Sequence(name, [1000 * arrival + i for i in range(prompt_len)], SamplingParams(max_tokens=output_len),
                   arrival=arrival)
    sch.add(seq)
    return seq


def _play(sch: Scheduler, seqs: list[Sequence], budget: int, max_steps: int = 1000) -> dict[str, int]:
    """Runs steps until every sequence ends; returns each one's first-token step (1-based) and
    checks, at every step, what both orders promise."""
    first: dict[str, int] = {}
    admitted: list[str] = []
    for step in range(1, max_steps + 1):
        if not sch.has_work:
            assert admitted == [s.request_id for s in sorted(seqs, key=lambda s: s.arrival)], "admitted out of order"
            return first
        decoding = [s for s in sch.running if s.num_tokens - s.num_computed_tokens == 1]
        waiting_prefill = sum(s.num_tokens - s.num_computed_tokens for s in [*sch.running, *sch.waiting]
                              if s.num_tokens - s.num_computed_tokens > 1)
        plan = sch.schedule()
        chosen = dict(plan.scheduled)
        assert not plan.preempted
        assert all(chosen.get(s) == 1 for s in decoding), "a decode lost its token"
        assert plan.num_tokens <= budget
        if waiting_prefill >= budget:
            assert plan.num_tokens == budget, f"step {step} left budget unspent while prompts waited"
        admitted += [s.request_id for s in sch.running if s.request_id not in admitted]  # in admission order
        sch.advance(plan, {})
        for seq, _ in plan.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                first.setdefault(seq.request_id, step)
                seq.append_token(7)
                if seq.num_output_tokens == seq.params.max_tokens:
                    sch.finish(seq, "length")
        sch.publish(plan)
    raise AssertionError("the sequences did not finish")


def test_fcfs_burst_reaches_first_tokens_in_arrival_order_one_budget_per_step() -> None:
    """FCFS: 8 prompts of 64 tokens, budget 128: two prompts' worth per step, in arrival order (the
    decodes of earlier ones take a token each, so later prompts slip by part of a step)."""
    sch = _scheduler("fcfs", 128)
    seqs = [_add(sch, f"r{i}", 64, 8, i) for i in range(8)]
    first = _play(sch, seqs, 128)
    steps = [first[f"r{i}"] for i in range(8)]
    assert steps == sorted(steps) and steps[:2] == [1, 1]
    assert steps[-1] == 5  # 512 prompt tokens + the decodes in between: just past 4 budgets


def test_shared_burst_reaches_first_tokens_together_in_as_many_steps() -> None:
    """Shared: the same burst gets every first token in one step, the step FCFS's last one gets
    its (no budget lost to sharing); the median request waits for it too."""
    sch = _scheduler("shared", 128)
    seqs = [_add(sch, f"r{i}", 64, 8, i) for i in range(8)]
    first = _play(sch, seqs, 128)
    assert set(first.values()) == {4}  # 512 prompt tokens in exactly 4 full budgets


@pytest.mark.parametrize("order, long_first, short_first", [("fcfs", 4, 5), ("shared", 5, 1)])
def test_a_short_prompt_behind_a_long_one(order: str, long_first: int, short_first: int) -> None:
    """A 1024-token prompt, then a 32-token one, budget 256: FCFS holds the short one until the long
    prefill is done; shared gives it its first token in the first step, and the long one its own a
    step later (the short one's prompt and decodes took that much of the budget)."""
    sch = _scheduler(order, 256)
    seqs = [_add(sch, "long", 1024, 4, 0), _add(sch, "short", 32, 4, 1)]
    first = _play(sch, seqs, 256)
    assert (first["long"], first["short"]) == (long_first, short_first)


@pytest.mark.parametrize("order", ["fcfs", "shared"])
def test_more_prompts_than_block_shares_still_admit_in_order(order: str) -> None:
    """40 prompts of 48 tokens against a budget of 256 (16 blocks): shares never go below a block,
    so at most 16 prompts start per step, earliest first, and everyone finishes."""
    sch = _scheduler(order, 256)
    seqs = [_add(sch, f"r{i:02d}", 48, 2, i) for i in range(40)]
    first = _play(sch, seqs, 256)
    steps = [first[f"r{i:02d}"] for i in range(40)]
    assert steps == sorted(steps)  # no later arrival gets its first token before an earlier one


def test_unknown_prefill_order_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown prefill order 'lifo'"):
        SchedulerConfig(prefill_order="lifo")
