"""The engine's scheduling and KV bookkeeping, exercised with the deterministic stand-in model.

The stand-in predicts from what it reads back out of the KV cache, so every finished request's
tokens must equal `stand_in_generate` of its prompt: a wrong block table, slot, prefix hit,
chunk boundary or preemption shows up as a wrong token. After every step the pool, the radix
tree and the block tables are checked against each other (`check_kv_invariants`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.attention import AttentionMetadata
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.sequence import Sequence
from nanoserve.runtime.stand_in import (
    STAND_IN_MAX_LEN,
    StandInModel,
    stand_in_engine,
    stand_in_generate,
    stand_in_next,
)

from support.kv_invariants import check_kv_invariants

# The stand-in's tensors are tiny: a second intra-op thread only adds barrier waits.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _sequences(engine: LLMEngine) -> dict[tuple[str, int], Sequence]:
    return {r.key: r for r in [*engine.scheduler.running, *engine.scheduler.waiting]}


def check_engine(engine: LLMEngine) -> None:
    """Sequence states agree with the scheduler, and the KV bookkeeping with the live tables."""
    sch, bs = engine.scheduler, engine.kv.block_size
    keys = [r.key for r in [*sch.running, *sch.waiting]]
    assert len(keys) == len(set(keys)), "a sequence is queued twice"
    for req in sch.waiting:
        assert not req.table.blocks and req.table.node is None and req.num_computed_tokens == 0
    for req in sch.running:
        assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
        assert 0 < req.num_computed_tokens < req.num_tokens
        assert len(req.table.blocks) >= math.ceil(req.num_computed_tokens / bs)
        assert req.table.num_cached <= req.num_computed_tokens
    used = check_kv_invariants(engine.kv, [(r.table, r.all_token_ids) for r in sch.running])
    stats = engine.kv_stats()
    evictable = engine.kv.cache.evictable_blocks if engine.kv.cache else 0
    assert stats.blocks_used == len(used)
    assert stats.blocks_used + stats.blocks_free + evictable == stats.blocks_total
    assert stats.blocks_cached == engine.kv.num_cached_blocks


def check_drained(engine: LLMEngine) -> None:
    """Nothing left to run, and every block comes back (after evicting the whole cache)."""
    assert not engine.has_unfinished()
    check_engine(engine)
    kv = engine.kv
    cached = kv.cache.total_blocks if kv.cache else 0
    assert kv.pool.num_free + cached == kv.pool.num_blocks
    if kv.cache is not None:
        kv.cache.evict(kv.pool.num_blocks)
    assert kv.pool.num_free == kv.pool.num_blocks


# ---------------------------------------------------------------------------------------------
# Random workloads


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    arrival: int
    abort_after: int | None
    n: int
    priority: int


@dataclass(frozen=True)
class Workload:
    engine_args: dict
    jobs: list[Job]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4]) | st.integers(1, 16))  # small ones share more prefixes
    kv = draw(st.sampled_from(["paged", "paged", "contiguous"]))
    prefix = kv == "paged" and draw(st.sampled_from([True, True, False]))
    max_len = draw(st.integers(4, 48))
    bases = draw(st.lists(st.lists(st.integers(0, 2), min_size=max_len, max_size=max_len), min_size=1,
                          max_size=2))
    jobs = []
    for _ in range(draw(st.integers(1, 8))):
        total = draw(st.integers(2, max_len))
        prompt_len = draw(st.integers(1, total - 1))
        shared = draw(st.sampled_from([prompt_len, prompt_len - 1, draw(st.integers(0, prompt_len))]))
        prompt = draw(st.sampled_from(bases))[:shared] + draw(
            st.lists(st.integers(0, 2), min_size=prompt_len - shared, max_size=prompt_len - shared))
        jobs.append(Job(prompt, total - prompt_len, draw(st.integers(0, 6)),
                        draw(st.none() | st.integers(0, 20)), draw(st.sampled_from([1, 1, 1, 2, 3])),
                        draw(st.integers(0, 2))))
    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    min_blocks = math.ceil((max_len if kv == "contiguous" else longest) / block_size)
    args = dict(
        block_size=block_size, kv=kv, enable_prefix_caching=prefix, max_model_len=max_len,
        num_kv_blocks=min_blocks + draw(st.integers(0, min_blocks)),
        max_num_batched_tokens=draw(st.integers(1, 40)), max_num_seqs=draw(st.integers(1, 8)),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    return Workload(args, jobs)


def run_workload(w: Workload) -> tuple[LLMEngine, dict[tuple[str, int], list[int]], set[str]]:
    """Drives the engine step by step (arrivals and aborts between steps), checking after each."""
    engine = stand_in_engine(**w.engine_args)
    outputs: dict[tuple[str, int], list[int]] = {}
    finished: set[tuple[str, int]] = set()
    aborted: set[str] = set()
    bound = 50 + 10 * sum((len(j.prompt) + j.max_tokens) * j.n for j in w.jobs)
    last_arrival = max(j.arrival for j in w.jobs)
    for step in range(bound):
        for rid, job in enumerate(w.jobs):
            if job.arrival == step:
                engine.add_request(str(rid), job.prompt, _params(job.max_tokens, job.n), priority=job.priority)
                outputs.update({(str(rid), i): [] for i in range(job.n)})
            if job.abort_after is not None and step == job.arrival + job.abort_after and engine.abort(str(rid)):
                aborted.add(str(rid))  # abort_after == 0: aborted while still waiting
        if step > last_arrival and not engine.has_unfinished():
            break
        for delta in engine.step().deltas:
            key = (delta.request_id, delta.index)
            assert key not in finished, "a token after the end"
            assert len(delta.token_ids) == 1
            outputs[key].extend(delta.token_ids)
            if delta.finished:
                assert delta.finish_reason == "length"
                finished.add(key)
        check_engine(engine)
    else:
        pytest.fail(f"not done after {bound} steps: a request waits forever")
    return engine, outputs, aborted


@settings(max_examples=250, deadline=None)
@given(w=workloads())
@pytest.mark.slow
def test_random_workloads_are_exact_and_return_every_block(w: Workload):
    engine, outputs, aborted = run_workload(w)
    for (rid, _), tokens in outputs.items():
        job = w.jobs[int(rid)]
        reference = stand_in_generate(job.prompt, job.max_tokens)
        if rid in aborted:
            assert tokens == reference[: len(tokens)]
        else:
            assert tokens == reference
    check_drained(engine)


# ---------------------------------------------------------------------------------------------
# The stand-in itself


def test_stand_in_reads_its_answer_from_the_cache():
    """The right block table and positions give the reference token; a permuted table, a wrong
    slot or a wrong position does not."""
    model = StandInModel()
    bs, tokens = 4, [5, 9, 2, 7, 1, 3, 8, 6, 4]
    table = [2, 0, 3]
    slots = [table[p // bs] * bs + p % bs for p in range(len(tokens))]
    positions = list(range(len(tokens)))

    def run(start: int, end: int, cache: torch.Tensor, tables: list[int] = table, slot_mapping: list[int] = slots,
            pos: list[int] = positions) -> int:
        """Computes tokens[start:end] of the sequence (the ones before are in `cache`)."""
        n = end - start
        meta = AttentionMetadata.build(slot_mapping[start:end], [tables], [0, n], [end], num_decodes=int(n == 1),
                                       block_size=bs)
        hidden = model(torch.tensor(tokens[start:end]), torch.tensor(pos[start:end]), cache, meta, None)  # type: ignore[arg-type]
        logits = model.compute_logits(hidden[-1:])
        assert logits.shape == (1, model.vocab_size) and logits.dtype == torch.float32
        return int(logits.argmax())

    def fresh() -> torch.Tensor:
        return torch.zeros(1, 2, 4, bs, 1, 1, dtype=model.dtype)

    last, expected = len(tokens), stand_in_next(tokens)
    assert run(0, last, fresh()) == expected
    cache = fresh()
    assert run(0, last - 1, cache) == stand_in_next(tokens[:-1])
    assert run(last - 1, last, cache) == expected  # the earlier tokens are read back from the cache
    assert run(0, last, fresh(), tables=[0, 2, 3]) != expected
    assert run(0, last, fresh(), slot_mapping=[*slots[:3], slots[4], slots[3], *slots[5:]]) != expected
    assert run(0, last, fresh(), pos=[*positions[:-1], last]) != expected
    assert stand_in_generate(tokens, 3) == [
        a := stand_in_next(tokens), b := stand_in_next([*tokens, a]), stand_in_next([*tokens, a, b])]



def test_stand_in_is_exact_at_the_longest_context():
    """Largest vocabulary, largest ids, STAND_IN_MAX_LEN tokens: float64 must still be exact."""
    vocab = 4096
    engine = stand_in_engine(vocab_size=vocab, max_num_batched_tokens=4096)
    prompt = [vocab - 1 - (i % 7) for i in range(STAND_IN_MAX_LEN - 16)]
    engine.add_request("long", prompt, _params(16))
    tokens: list[int] = []
    while engine.has_unfinished():
        for d in engine.step().deltas:
            tokens.extend(d.token_ids)
    assert tokens == stand_in_generate(prompt, 16, vocab)

# ---------------------------------------------------------------------------------------------
# Scenarios


def _run_order(engine: LLMEngine, jobs: list[tuple[str, int]]) -> list[str]:
    """Runs requests added before the first step; returns request ids in order of first token."""
    for rid, priority in jobs:
        engine.add_request(rid, [int(rid)] * 6, _params(3), priority=priority)
    started: list[str] = []
    while engine.has_unfinished():
        for delta in engine.step().deltas:
            if delta.request_id not in started:
                started.append(delta.request_id)
        check_engine(engine)
    check_drained(engine)
    return started


def test_fcfs_runs_requests_in_arrival_order():
    engine = stand_in_engine(max_num_seqs=1)
    assert _run_order(engine, [("3", 0), ("1", 2), ("2", 1), ("0", 0)]) == ["3", "1", "2", "0"]


def test_priority_policy_runs_lower_values_first_fcfs_among_equals():
    engine = stand_in_engine(max_num_seqs=1, scheduling_policy="priority")
    assert _run_order(engine, [("3", 2), ("1", 0), ("2", 1), ("0", 0)]) == ["1", "0", "2", "3"]


def test_long_prompt_is_chunked_while_every_decode_keeps_its_token():
    budget = 16
    engine = stand_in_engine(block_size=4, max_num_batched_tokens=budget)
    prompts = {f"s{i}": [7, i, 3, i] for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _params(40))
    engine.step()  # all three prompts fit in one step; from now on they decode
    prompts["long"] = list(range(100))
    engine.add_request("long", prompts["long"], _params(40))
    long_req = _sequences(engine)[("long", 0)]
    chunked_steps = 0
    while long_req.num_output_tokens == 0:
        decodes = [r.key for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        assert len(decodes) == 3
        before = long_req.num_computed_tokens
        emitted = {(d.request_id, d.index) for d in engine.step().deltas}
        assert set(decodes) <= emitted, "a running decode was skipped for the prefill"
        assert 0 < long_req.num_computed_tokens - before <= budget - len(decodes)
        chunked_steps += 1
        check_engine(engine)
    assert chunked_steps >= math.ceil(len(prompts["long"]) / (budget - 3))
    seqs = _sequences(engine)
    while engine.has_unfinished():
        engine.step()
    for rid, prompt in prompts.items():
        assert seqs[(rid, 0)].output_token_ids == stand_in_generate(prompt, 40)
    check_drained(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_takes_the_newest_and_keeps_its_tokens(prefix_caching: bool):
    engine = stand_in_engine(block_size=4, num_kv_blocks=12, enable_prefix_caching=prefix_caching)
    prompts = {"old": [1, 2, 3, 4, 5, 6, 7, 8], "new": [8, 7, 6, 5, 4, 3, 2, 1]}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, _params(24))
    seqs = _sequences(engine)
    old, new = seqs[("old", 0)], seqs[("new", 0)]
    emitted: dict[str, list[int]] = {"old": [], "new": []}
    was_preempted = False
    while engine.has_unfinished():
        generated_before = list(new.output_token_ids)
        for d in engine.step().deltas:
            emitted[d.request_id].extend(d.token_ids)
        check_engine(engine)
        if new.num_preemptions and not was_preempted:
            was_preempted = True
            assert engine.scheduler.waiting[0] is new and new.num_computed_tokens == 0
            assert new.output_token_ids == generated_before and generated_before  # kept, not reset
        assert emitted["new"] == new.output_token_ids  # nothing streamed twice
    assert was_preempted and old.num_preemptions == 0
    for rid, prompt in prompts.items():
        assert emitted[rid] == stand_in_generate(prompt, 24)
    check_drained(engine)


def test_priority_preemption_takes_the_lowest_priority():
    engine = stand_in_engine(block_size=4, num_kv_blocks=12, scheduling_policy="priority")
    engine.add_request("low", [1, 2, 3, 4, 5, 6, 7, 8], _params(24), priority=1)
    engine.step()
    engine.add_request("high", [8, 7, 6, 5, 4, 3, 2, 1], _params(24), priority=0)
    seqs = _sequences(engine)
    while engine.has_unfinished():
        engine.step()
        check_engine(engine)
    assert seqs[("low", 0)].num_preemptions > 0 and seqs[("high", 0)].num_preemptions == 0
    check_drained(engine)


def test_parallel_samples_share_prompt_blocks_through_the_prefix_cache():
    bs, prompt = 4, list(range(41))
    engine = stand_in_engine(block_size=bs)
    engine.add_request("r", prompt, _params(6, n=3))
    seqs = _sequences(engine)
    cached: dict[int, int] = {}
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    shared_seen = False
    while engine.has_unfinished():
        for d in engine.step().deltas:
            outputs[d.index].extend(d.token_ids)
            cached[d.index] = d.num_cached_tokens
        running = engine.scheduler.running
        if len(running) == 3:
            prompt_blocks = [r.table.blocks[: len(prompt) // bs] for r in running]
            assert prompt_blocks[0] == prompt_blocks[1] == prompt_blocks[2]
            for b in prompt_blocks[0]:
                assert engine.kv.pool.ref_counts[b] == 4  # three siblings and the tree
            shared_seen = True
        check_engine(engine)
    assert shared_seen
    assert cached == {0: 0, 1: 40, 2: 40}
    assert all(seqs[("r", i)].num_cached_tokens == cached[i] for i in range(3))
    assert all(out == stand_in_generate(prompt, 6) for out in outputs.values())
    check_drained(engine)


def test_a_request_that_waits_reports_the_hit_it_was_admitted_with():
    """R matches a cached prefix but cannot be admitted (A holds the pool); A then evicts that
    prefix. R must report (and the stats count) the hit of its actual admission, once."""
    engine = stand_in_engine(block_size=4, num_kv_blocks=16)
    prefix = list(range(100, 112))
    engine.add_request("F", prefix, _params(1))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_cached_blocks == 3
    engine.add_request("A", [1, 2, 3, 4], _params(56))
    engine.step()
    (a,) = engine.scheduler.running
    while len(a.table.blocks) < 13:
        engine.step()
    engine.add_request("R", [*prefix, 7, 7, 7, 7, 7], _params(3))
    r = _sequences(engine)[("R", 0)]
    reported = None
    waited = 0
    while engine.has_unfinished():
        waited += r.status.value == "waiting"
        for d in engine.step().deltas:
            if d.request_id == "R":
                reported = d.num_cached_tokens
        check_engine(engine)
    assert waited > 1 and engine.kv.cache is not None and engine.kv.cache.evictions >= 3
    assert reported == r.num_cached_tokens == 0
    stats = engine.kv_stats()
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (12 + 4 + 17, 0)
    assert r.output_token_ids == stand_in_generate([*prefix, 7, 7, 7, 7, 7], 3)
    check_drained(engine)
