"""The engine: requests in, one scheduled and batched model step at a time, output deltas out.

`add_request` validates and queues; `step` runs scheduler -> runner -> sampler -> postprocess
and returns what each sequence produced in that step; `abort` ends a request and frees its
blocks at once. Single-threaded: the server drives it from one engine thread.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nanoserve.attention import TritonAttention, select_backend
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.model_runner import KVShape, Model, ModelRunner
from nanoserve.engine.output import TextStream
from nanoserve.engine.request import Request
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.spec_decode import Proposer, SpecStats
from nanoserve.kv.manager import KVCacheManager
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence produced in one step. `text` is final (never revised). The token that
    ended a sequence by EOS or a stop id is in `token_ids` but not in `text`."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class KVStats(NamedTuple):
    """Pool occupancy. used: referenced by live sequences; cached: held by the prefix tree (some of
    them may also be used); free: on the free list. used + free + unpinned cached == total."""

    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_evicted_blocks: int


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What decides whether a request can ever run, apart from the engine (a front end in another
    process validates with it before anything is queued). `reserve_blocks`: blocks every sequence
    takes whatever its length (the contiguous layout), else 0."""

    max_model_len: int
    num_blocks: int
    block_size: int
    reserve_blocks: int
    vocab_size: int
    detokenizes: bool

    @property
    def max_tokens_in_pool(self) -> int:
        """The most tokens one sequence can hold: the context length or the whole pool."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, with the numbers, when a request can never run."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{total} ({len(prompt_ids)} in the prompt + {params.max_tokens} max_tokens)"
            )
        blocks = self.reserve_blocks or -(-total // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks; the pool has {self.num_blocks}")
        if params.stop and not self.detokenizes:
            raise ValueError("stop strings need a tokenizer")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")


@dataclass(slots=True)
class _Sequence:
    request: Request
    stream: TextStream | None


@dataclass(slots=True)
class _Group:
    """The n sequences of one request."""

    sequences: list[_Sequence] = field(default_factory=list)


def use_cuda_graphs(runner: ModelRunner, num_kv_heads: int, args: EngineArgs) -> None:
    """Captures the runner's decode steps as CUDA graphs on a CUDA device unless `enforce_eager`;
    they need the Triton attention backend (its fixed-split decode path is graph-safe)."""
    if runner.device.type != "cuda" or args.enforce_eager:
        return
    if not isinstance(runner.backend, TritonAttention):
        log.info("CUDA graphs need the triton attention backend; decode steps run eagerly")
        return
    assert args.max_model_len is not None
    runner.use_decode_graphs(num_kv_heads, args.max_num_seqs, args.max_model_len)


class LLMEngine:
    def __init__(self, model: Model, tokenizer: Tokenizer | None, kv_shape: KVShape, vocab_size: int,
                 args: EngineArgs, stop_token_ids: frozenset[int] = frozenset(),
                 proposer: Proposer | None = None, num_blocks: int | None = None) -> None:
        """`tokenizer=None` skips detokenization (token ids only; stop strings then unsupported).
        With a `proposer`, decoding sequences verify up to `args.num_speculative_tokens` drafts a step."""
        self.args = args
        self.tokenizer = tokenizer
        self.device = torch.device(args.device)
        self.max_model_len = args.max_model_len
        if num_blocks is None:
            num_blocks = args.resolve_num_blocks(kv_shape.bytes_per_block(args.block_size, model.dtype))
        self.kv = KVCacheManager(
            num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching and args.kv == "paged",
            reserve_tokens=args.max_model_len if args.kv == "contiguous" else None,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy), self.kv
        )
        self.stop_token_ids = stop_token_ids
        self.runner = ModelRunner(model, kv_shape, num_blocks, args.block_size, vocab_size, stop_token_ids,
                                  self.device, select_backend(args.attention_backend, self.device))
        use_cuda_graphs(self.runner, kv_shape.num_kv_heads, args)
        self.limits = EngineLimits(self.max_model_len, num_blocks, args.block_size, self.kv.reserve_blocks or 0,
                                   vocab_size, tokenizer is not None)
        self.proposer = proposer
        self.num_speculative_tokens = args.num_speculative_tokens
        self.spec_stats = SpecStats()
        self._groups: dict[str, _Group] = {}
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        log.info("KV cache: %d blocks of %d tokens (%s layout, prefix cache %s)", num_blocks, args.block_size,
                 args.kv, "on" if self.kv.cache else "off")

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, with the numbers, when a request can never run."""
        self.limits.validate(prompt_ids, params)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params)
        group = _Group()
        for i in range(params.n):
            req = Request(request_id, list(prompt_ids), params, next(self._arrivals), index=i, priority=priority)
            if i and self.kv.cache is not None:
                req.wait_for = group.sequences[0].request
            stream = None
            if self.tokenizer is not None:
                stream = TextStream(self.tokenizer, req.prompt_token_ids, params.stop, params.skip_special_tokens)
            group.sequences.append(_Sequence(req, stream))
        for seq in group.sequences:  # only once every sequence was built: all or nothing
            self.scheduler.add(seq.request)
        self._groups[request_id] = group
        self.num_prompt_tokens += len(prompt_ids)

    def abort(self, request_id: str) -> bool:
        """Ends every sequence of the request now and frees its blocks; False if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.sequences:
            self.scheduler.finish(seq.request, "abort")
            self.runner.release(seq.request)
            if self.proposer is not None:
                self.proposer.release(seq.request)
        return True

    def step(self) -> list[SequenceDelta]:
        """Runs one batched step; returns one delta per sequence that produced tokens or ended."""
        plan = self.scheduler.schedule()
        if self.proposer is not None:
            for req in plan.preempted:
                self.proposer.release(req)
        if not plan.scheduled:
            return []
        result = self.runner.execute(plan)
        rejected = {}
        for req, kept in result.verified:
            rejected[req] = req.num_draft_tokens + 1 - len(kept)
            self.spec_stats.record(req.num_draft_tokens, len(kept) - 1)
            if self.proposer is not None:
                self.proposer.accepted(req, len(kept) - 1)
        self.scheduler.advance(plan, rejected)
        out = result.sampled
        deltas = []
        for row, req in enumerate(result.requests):
            delta = self._postprocess(req, [out.token_ids[row]])
            if out.logprobs is not None and out.top_logprobs is not None and req.params.logprobs is not None:
                delta.logprobs, delta.top_logprobs = [out.logprobs[row]], [out.top_logprobs[row]]
            deltas.append(delta)
        deltas.extend(self._postprocess(req, kept) for req, kept in result.verified)
        self.scheduler.publish(plan)
        if self.proposer is not None:
            self._propose()
        self.num_generated_tokens += sum(len(d.token_ids) for d in deltas)
        return deltas

    def _postprocess(self, req: Request, tokens: list[int]) -> SequenceDelta:
        """Appends the step's tokens one by one, stopping at the first that ends the sequence."""
        seq = self._groups[req.request_id].sequences[req.index]
        p = req.params
        reason = None
        text = ""
        kept = []
        for token in tokens:
            req.append_token(token)
            kept.append(token)
            if (not p.ignore_eos and token in self.stop_token_ids) or token in p.stop_token_ids:
                reason = "stop"
            elif seq.stream is not None:
                text += seq.stream.push(token)
                if seq.stream.stopped:
                    reason = "stop"
            if reason is None and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            if seq.stream is not None:
                text += seq.stream.finish()
            self._finish(req, reason)
        return SequenceDelta(req.request_id, req.index, kept, text, reason, num_prompt_tokens=req.num_prompt_tokens,
                             num_cached_tokens=max(req.num_cached_tokens, 0))

    def _propose(self) -> None:
        """Drafts for every running sequence in decode whose sampling speculation keeps exact:
        no penalties (they would change between drafts), no logprobs, min_tokens reached; none while
        more sequences run than `speculative_disable_by_batch_size` (a batch that large already
        reads each weight once for many tokens, so drafts cost more than they save; a draft model
        catches up on the tokens it missed when it drafts again)."""
        assert self.proposer is not None
        limit = self.args.speculative_disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        candidates, budgets = [], []
        for req in self.scheduler.running:
            p = req.params
            if (req.num_tokens - req.num_computed_tokens != 1 or p.uses_penalties or p.logprobs is not None
                    or req.num_output_tokens < p.min_tokens):
                continue
            k = min(self.num_speculative_tokens, p.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            if k > 0:
                candidates.append(req)
                budgets.append(k)
        if candidates:
            for req, proposal in zip(candidates, self.proposer.propose(candidates, budgets), strict=True):
                req.draft = proposal if proposal.tokens else None

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)
        self.runner.release(req)
        if self.proposer is not None:
            self.proposer.release(req)
        group = self._groups[req.request_id]
        if all(s.request.finished for s in group.sequences):
            del self._groups[req.request_id]

    def kv_stats(self) -> KVStats:
        pool, cache = self.kv.pool, self.kv.cache
        evictable = cache.evictable_blocks if cache else 0
        return KVStats(
            blocks_total=pool.num_blocks, blocks_used=pool.num_blocks - pool.num_free - evictable,
            blocks_free=pool.num_free, blocks_cached=self.kv.num_cached_blocks,
            prefix_queried_tokens=self.kv.stats.queried_tokens, prefix_hit_tokens=self.kv.stats.hit_tokens,
            prefix_evicted_blocks=cache.evictions if cache else 0,
        )
