"""The batch builder: a StepPlan's flat tensors, spelled out by hand for a mixed step; the memory
profile's synthetic plan; and drafts cut to the step's budget by the scheduler."""

from __future__ import annotations

import torch

from nanoserve.engine.batch import prepare_batch
from nanoserve.engine.memory_profile import synthetic_plan
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.spec_decode import Proposal
from nanoserve.kv.manager import BlockTable, KVCacheManager

CPU = torch.device("cpu")


def _seq(name: str, num_tokens: int, computed: int, blocks: list[int], draft: list[int] | None = None) -> Sequence:
    req = Sequence(name, [100 * (ord(name) - ord("a")) + i for i in range(num_tokens)], SamplingParams(), arrival=0,
                  table=BlockTable(blocks))
    req.num_computed_tokens = computed
    req.draft = None if draft is None else Proposal(draft, None)
    return req


def test_mixed_step_spelled_out() -> None:
    """Decodes first by context length, then in plan order a sequence with drafts, a prefill chunk
    that stops short of the prompt's end and one that reaches it (block size 4)."""
    a = _seq("a", 11, 10, [3, 7, 1])  # decode at position 10: block 1, offset 2
    b = _seq("b", 6, 5, [2, 5])  # decode at position 5: block 5, offset 1
    c = _seq("c", 8, 7, [0, 4, 6], draft=[90, 91])  # last token and two drafts at 7, 8, 9
    d = _seq("d", 12, 4, [8, 9, 10])  # chunk 4..7 of 12: no logits row
    e = _seq("e", 5, 0, [11, 12])  # the whole prompt: its last token is sampled
    batch = prepare_batch(StepPlan([(c, 3), (d, 4), (a, 1), (e, 5), (b, 1)]), 4, CPU)
    assert batch.input_ids.tolist() == [105, 10, 207, 90, 91, 304, 305, 306, 307, 400, 401, 402, 403, 404]
    assert batch.positions.tolist() == [5, 10, 7, 8, 9, 4, 5, 6, 7, 0, 1, 2, 3, 4]
    meta = batch.meta
    assert meta.slot_mapping.tolist() == [21, 6, 19, 24, 25, 36, 37, 38, 39, 44, 45, 46, 47, 48]
    assert meta.block_tables.tolist() == [[2, 5, 0], [3, 7, 1], [0, 4, 6], [8, 9, 10], [11, 12, 0]]
    assert meta.query_start_loc_cpu == meta.query_start_loc.tolist() == [0, 1, 2, 5, 9, 14]
    assert meta.seq_lens_cpu == meta.seq_lens.tolist() == [6, 11, 10, 8, 5]
    assert meta.num_decodes == 2 and meta.block_size == 4
    assert batch.sampled == [b, a, e] and batch.verified == [c]
    assert isinstance(batch.logits_rows, torch.Tensor) and batch.logits_rows.tolist() == [0, 1, 13, 2, 3, 4]

    head = meta.head(3)  # the first three sequences, as views
    assert head.slot_mapping.tolist() == [21, 6, 19, 24, 25] and head.seq_lens_cpu == [6, 11, 10]
    assert head.query_start_loc.tolist() == [0, 1, 2, 5] and head.num_decodes == 2
    assert head.block_tables.data_ptr() == meta.block_tables.data_ptr()


def test_decodes_and_verifications_take_every_row() -> None:
    a = _seq("a", 3, 2, [0])
    c = _seq("c", 5, 4, [1, 2], draft=[7])
    batch = prepare_batch(StepPlan([(c, 2), (a, 1)]), 4, CPU)
    assert batch.logits_rows == slice(None)
    assert batch.sampled == [a] and batch.verified == [c] and batch.positions.tolist() == [2, 4, 5]


def test_synthetic_profile_plan() -> None:
    """50 prompt tokens with max_model_len 20: sequences of 20, 20 and 10 tokens, each in its own
    blocks of the scratch pool, every one sampled at its end."""
    plan = synthetic_plan(50, max_model_len=20, block_size=16)
    assert [n for _, n in plan.scheduled] == [20, 20, 10]
    assert [seq.table.blocks for seq, _ in plan.scheduled] == [[0, 1], [2, 3], [4]]
    batch = prepare_batch(plan, 16, CPU)
    assert batch.input_ids.tolist() == [0] * 50
    assert batch.positions.tolist() == [*range(20), *range(20), *range(10)]
    assert batch.meta.slot_mapping.tolist() == [*range(20), *range(32, 52), *range(64, 74)]
    assert batch.meta.num_decodes == 0 and batch.meta.seq_lens_cpu == [20, 20, 10]
    assert isinstance(batch.logits_rows, torch.Tensor) and batch.logits_rows.tolist() == [19, 39, 49]


def _decoding(budget: int, prompt_len: int = 4) -> tuple[Scheduler, Sequence]:
    """A scheduler with `budget` tokens a step and one sequence whose prompt is computed."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(16, 4))
    req = Sequence("r", list(range(prompt_len)), SamplingParams(), arrival=0)
    scheduler.add(req)
    while req.num_computed_tokens < req.num_tokens:
        scheduler.advance(scheduler.schedule(), {})
    req.append_token(9)
    return scheduler, req


def test_scheduler_cuts_drafts_to_the_budget() -> None:
    probs = torch.rand(4, 11)
    scheduler, req = _decoding(budget=4)
    req.draft = Proposal([1, 2, 3, 4], probs)
    assert scheduler.schedule().scheduled == [(req, 4)]
    assert isinstance(req.draft, Proposal) and req.draft.tokens == [1, 2, 3]
    assert req.draft.probs is not None and torch.equal(req.draft.probs, probs[:3])

    scheduler, req = _decoding(budget=1)
    req.draft = Proposal([1, 2], None)
    assert scheduler.schedule().scheduled == [(req, 1)] and req.draft is None  # no room for a draft
