"""The engine: requests in, one scheduled and batched model step at a time, output deltas out.

`add_request` validates and queues; `step` runs scheduler -> runner -> sampler -> postprocess
and returns what each sequence produced in that step and which requests ended in it; `abort`
ends a request and frees its blocks at once. Single-threaded: the server drives it from one
engine thread. A request with a structured-output constraint not yet compiled waits outside the
scheduler while the grammar compiler's threads compile it (vLLM's WAITING_FOR_FSM): the loop never
compiles, and other requests keep stepping. A pooling request (`SamplingParams.pooling`) runs its
prompt like any prefill and ends in the step that computes its last prompt token, its one delta
carrying the embedding (see `nanoserve.engine.pooling`); its blocks are cached and freed as a
finished request's are. Built by `nanoserve.runtime.builder`, which sizes
everything it is given; what leaves it is typed in `nanoserve.engine.outputs`, and front ends read
its state through the read-only accessors below, never through the scheduler or the KV manager.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import torch

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.expert_load import ExpertMeter
from nanoserve.engine.live_stats import LiveStats
from nanoserve.engine.model_protocol import Model
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.outputs import (
    EngineLimits,
    EngineSnapshot,
    KVStats,
    PromptLogprob,
    SequenceDelta,
    SequenceProgress,
    StepOutput,
)
from nanoserve.engine.prediction import PredictionProposer
from nanoserve.engine.sampling_params import SamplingParams, resolve_bad_words, resolve_prediction
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.sequence import Sequence, Status
from nanoserve.engine.spec_decode import Proposer, SpecStats
from nanoserve.engine.structured import GrammarCompiler
from nanoserve.kv.manager import KVCacheManager
from nanoserve.model.checkpoint.pooling import PoolingConfig
from nanoserve.tokenizer import Tokenizer
from nanoserve.tokenizer.text_stream import TextStream

log = logging.getLogger(__name__)

# How long a step with nothing to schedule waits for a grammar being compiled before it returns
# (and the caller looks at its commands again).
COMPILE_WAIT_S = 0.02


@dataclass(slots=True)
class _Group:
    """The n sequences of one request, and each one's text stream (None without a tokenizer)."""

    sequences: list[Sequence]
    streams: list[TextStream | None]


class LLMEngine:
    def __init__(self, runner: ModelRunner, num_blocks: int, tokenizer: Tokenizer | None, args: EngineArgs,
                 proposer: Proposer | None = None, sampling_defaults: dict[str, float | int] | None = None,
                 pooling: PoolingConfig | None = None) -> None:
        """`runner`: over a KV pool of `num_blocks` blocks of `args.block_size` tokens; `args`
        resolved (max_model_len set). `tokenizer=None` skips detokenization (token ids only; stop
        strings then unsupported). With a `proposer`, decoding sequences verify up to
        `args.num_speculative_tokens` drafts a step; so do sequences with a `prediction`, with or
        without one (their drafts come from the prediction, and from the proposer only in steps
        where the prediction has none to offer). `sampling_defaults`: SamplingParams fields
        front ends fill in when a request leaves them unset (the model's generation config).
        `pooling`: how the model makes embeddings (None: it takes no pooling request)."""
        if args.max_model_len is None:
            raise ValueError("the engine takes resolved EngineArgs (max_model_len set)")
        self.args = args
        self.tokenizer = tokenizer
        self.sampling_defaults: dict[str, float | int] = dict(sampling_defaults or {})
        self.device = torch.device(args.device)
        self.max_model_len: int = args.max_model_len
        self.kv = KVCacheManager(
            num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching and args.kv == "paged",
            reserve_tokens=args.max_model_len if args.kv == "contiguous" else None,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy,
                            args.prefill_order), self.kv
        )
        self.runner = runner
        self.stop_token_ids = runner.stop_token_ids
        self.limits = EngineLimits(max_model_len=self.max_model_len, num_blocks=num_blocks, block_size=args.block_size,
                                   reserve_blocks=self.kv.reserve_blocks, vocab_size=runner.vocab_size,
                                   detokenizes=tokenizer is not None, pooling=pooling)
        self.proposer = proposer
        self.predictions = PredictionProposer()
        self._predicted: set[Sequence] = set()  # sequences whose pending drafts came from their prediction
        # Structured output needs the tokenizer (the grammar is over its tokens' bytes).
        self.grammars = None if tokenizer is None else GrammarCompiler(tokenizer)
        runner.grammars = self.grammars
        self._told_no_drafts = False  # logged once that constrained sequences get no drafts
        self.num_speculative_tokens = args.num_speculative_tokens
        self.spec_stats = SpecStats()
        self._groups: dict[str, _Group] = {}
        # Requests whose constraint compiles: in _groups, their sequences not yet in the scheduler.
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._failed: dict[str, str] = {}  # requests failed since the last step's output
        self._arrivals = itertools.count()
        self._finished: list[str] = []  # requests whose last sequence ended in the current step
        # Prompt logprobs by sequence, filled by position (entry p: prompt token p + 1) until its first token.
        self._prompt_logprobs: dict[Sequence, list[PromptLogprob | None]] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        warm = runner.take_expert_load()  # what warm-up and profiling passes routed: dropped
        # A mixture of experts' load per step (None for a dense model: nothing is counted).
        self.experts = None if warm is None else ExpertMeter(runner.expert_bytes(), warm.shape[1])
        self.live_stats = LiveStats(self.scheduler, self.kv, self.snapshot)  # the dashboard's view, off by default
        log.info("KV cache: %d blocks of %d tokens (%s layout, prefix cache %s)", num_blocks, args.block_size,
                 args.kv, "on" if self.kv.cache else "off")

    # ---- read-only accessors: what front ends and benchmarks may know of the engine's state ----

    @property
    def num_blocks(self) -> int:
        return self.limits.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def model(self) -> Model:
        return self.runner.model

    @property
    def prefix_caching(self) -> bool:
        return self.kv.cache is not None

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted since the engine was built."""
        return self.scheduler.num_preemptions

    @property
    def num_running(self) -> int:
        """Requests any of whose sequences runs."""
        return len({r.request_id for r in self.scheduler.running})

    @property
    def num_waiting(self) -> int:
        """Requests none of whose sequences runs and one of which waits (to be admitted, or again
        after preemption)."""
        return len(self._groups) - self.num_running

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences waiting to be admitted (or again after preemption), those of requests whose
        constraint still compiles included."""
        return len(self.scheduler.waiting) + sum(len(self._groups[r].sequences) for r in self._compiling)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling)

    def started(self, request_id: str) -> bool:
        """Whether any sequence of the request has been admitted (False once it ended)."""
        group = self._groups.get(request_id)
        return group is not None and any(s.status is not Status.WAITING for s in group.sequences)

    def kv_stats(self) -> KVStats:
        return self.kv.snapshot()

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now, for a front end (counters since the engine was built)."""
        running = self.num_running
        return EngineSnapshot(num_running=running, num_waiting=len(self._groups) - running,
                              num_waiting_seqs=self.num_waiting_seqs, kv=self.kv.snapshot(),
                              prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generated_tokens,
                              spec=dataclasses.replace(self.spec_stats),
                              experts=None if self.experts is None else dataclasses.replace(self.experts.stats))

    @property
    def num_running_seqs(self) -> int:
        return len(self.scheduler.running)

    def num_decoding_seqs(self) -> int:
        """Running sequences whose next step is a decode (one token to compute, drafts aside)."""
        return sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.scheduler.running)

    def sequence_progress(self) -> dict[tuple[str, int], SequenceProgress]:
        """Every unfinished sequence's progress, by (request id, index) (benchmarks' accounting;
        not for the serving path: it walks every sequence)."""
        return {r.key: SequenceProgress(r.status is Status.RUNNING, r.num_tokens, r.num_computed_tokens)
                for r in (*self.scheduler.running, *self.scheduler.waiting)}

    @property
    def num_live_grammars(self) -> int:
        """Grammar matchers held by unfinished sequences."""
        return 0 if self.grammars is None else self.grammars.num_live

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, with the numbers, when a request can never run, and with the
        compiler's message when its structured-output constraint does not compile. Compiles on
        the calling thread (and caches): for the offline API, never on a serving loop."""
        self._check(prompt_ids, params)
        if params.structured is not None:
            assert self.grammars is not None  # _check checked it
            self.grammars.compile(params.structured)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.limits.validate(prompt_ids, params)
        if params.structured is not None and self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Queues a request; raises ValueError for one that can never run. A constraint is not
        compiled here: one not in the compiler's cache compiles on its threads, and the request
        waits unscheduled until it has (failing alone, in a later step's `failed`, if it does
        not compile)."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._check(prompt_ids, params)
        if self.tokenizer is not None:
            resolve_bad_words(params, self.tokenizer)
            resolve_prediction(params, self.tokenizer)
        group = _Group([], [])
        for i in range(params.n):
            seq = Sequence(request_id, list(prompt_ids), params, next(self._arrivals), index=i, priority=priority)
            if i and self.kv.cache is not None:
                seq.wait_for = group.sequences[0]
            group.sequences.append(seq)
            group.streams.append(None if self.tokenizer is None or params.pooling is not None else TextStream(
                self.tokenizer, seq.prompt_token_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output))
        compiled = None
        if params.structured is not None:
            assert self.grammars is not None  # _check checked it
            compiled = self.grammars.compile_async(params.structured)
        self._groups[request_id] = group
        self.num_prompt_tokens += len(prompt_ids)
        if compiled is None or (compiled.done() and compiled.exception() is None):
            self._schedule_group(group, compiled)
        else:
            self._compiling[request_id] = compiled

    def _schedule_group(self, group: _Group, compiled: Future[llguidance.LLMatcher] | None) -> None:
        """Gives each sequence its matcher (of a compiled grammar) and hands it to the scheduler."""
        for seq in group.sequences:
            if compiled is not None:
                assert self.grammars is not None
                seq.grammar = self.grammars.matcher(compiled.result())
            self.scheduler.add(seq)

    def _admit_compiled(self) -> None:
        """Schedules the requests whose constraint has compiled; fails those whose did not."""
        for request_id, compiled in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            group = self._groups[request_id]
            error = compiled.exception()
            if error is None:
                self._schedule_group(group, compiled)
                continue
            del self._groups[request_id]
            self._failed[request_id] = str(error)
            for seq in group.sequences:
                seq.status, seq.finish_reason = Status.FINISHED, "abort"

    def abort(self, request_id: str) -> bool:
        """Ends every sequence of the request now and frees its blocks; False if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        if self._compiling.pop(request_id, None) is not None:  # the compile runs on, and is cached
            for seq in group.sequences:
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
            return True
        for seq in group.sequences:
            self.scheduler.finish(seq, "abort")
            self._release_grammar(seq)
            self._prompt_logprobs.pop(seq, None)
            self.runner.release(seq)
            self._release_drafter(seq)
        return True

    def close(self) -> None:
        """Releases what the engine holds outside this process (tensor-parallel worker ranks);
        the engine takes no step after it."""
        self.runner.close()

    def step(self) -> StepOutput:
        """Runs one batched step; returns one delta per sequence that produced tokens or ended,
        the requests that ended in it, and those whose constraint failed to compile (see
        `StepOutput`). With nothing to schedule but constraints compiling, waits up to
        `COMPILE_WAIT_S` for one of them first."""
        self._admit_compiled()
        if self._compiling and not self.scheduler.has_work:
            concurrent.futures.wait(self._compiling.values(), COMPILE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
            self._admit_compiled()
        failed, self._failed = self._failed, {}
        started = self.live_stats.now()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self._release_drafter(seq)
        if not plan.scheduled:
            return StepOutput([], failed=failed)
        start = self.live_stats.step_started(plan, started)
        result = self.runner.execute(plan)
        step_experts = None
        if self.experts is not None and result.expert_load is not None:
            step_experts = self.experts.step(result.expert_load, sum(n for _, n in plan.scheduled))
        rejected = {}
        from_prediction: dict[Sequence, int] = {}  # sequence -> its prediction drafts verified this step
        for seq, kept in result.verified:
            rejected[seq] = seq.num_draft_tokens + 1 - len(kept)
            self.spec_stats.record(seq.num_draft_tokens, len(kept) - 1)
            seq.num_drafts_proposed += seq.num_draft_tokens
            seq.num_drafts_accepted += len(kept) - 1
            if seq in self._predicted:
                from_prediction[seq] = seq.num_draft_tokens
                self.predictions.accepted(seq, len(kept) - 1)
            elif self.proposer is not None:
                self.proposer.accepted(seq, len(kept) - 1)
        self.scheduler.advance(plan, rejected)
        for seq, first, entries in result.prompt_logprobs:
            known = self._prompt_logprobs.setdefault(seq, [None] * (seq.num_prompt_tokens - 1))
            known[first : first + len(entries)] = entries
        out = result.sampled
        deltas = []
        for seq, embedding in result.pooled:
            deltas.append(SequenceDelta(seq.request_id, seq.index, [], "", "stop",
                                        num_prompt_tokens=seq.num_prompt_tokens,
                                        num_cached_tokens=max(seq.num_cached_tokens, 0), embedding=embedding))
            self._finish(seq, "stop")
        for row, seq in enumerate(result.sequences):
            prompt_logprobs = None
            if seq.needs_prompt_logprobs:
                prompt_logprobs = [None, *self._prompt_logprobs.pop(seq, [])]
            delta = self._postprocess(seq, [out.token_ids[row]])
            delta.prompt_logprobs = prompt_logprobs
            if out.logprobs is not None and out.top_logprobs is not None and seq.params.logprobs is not None:
                delta.logprobs, delta.top_logprobs = [out.logprobs[row]], [out.top_logprobs[row]]
            deltas.append(delta)
        for seq, kept in result.verified:
            delta = self._postprocess(seq, kept)
            if seq in from_prediction:  # accepted: the drafts that became output (a stop may cut them)
                accepted = len(kept) - 1
                delta.accepted_prediction_tokens = min(accepted, len(delta.token_ids))
                delta.rejected_prediction_tokens = from_prediction[seq] - accepted
            deltas.append(delta)
        self.scheduler.publish(plan)
        self._predicted.clear()
        if self.proposer is not None or any(s.params.prediction_token_ids for s in self.scheduler.running):
            self._propose()
        self.num_generated_tokens += sum(len(d.token_ids) for d in deltas)
        finished, self._finished = self._finished, []
        self.live_stats.step_ended(start, plan, step_experts)
        return StepOutput(deltas, finished, failed)

    def _postprocess(self, seq: Sequence, tokens: list[int]) -> SequenceDelta:
        """Appends the step's tokens one by one, stopping at the first that ends the sequence."""
        stream = self._groups[seq.request_id].streams[seq.index]
        p = seq.params
        reason = None
        text = ""
        kept = []
        for token in tokens:
            seq.append_token(token)
            kept.append(token)
            if (not p.ignore_eos and token in self.stop_token_ids) or token in p.stop_token_ids:
                reason = "stop"
            elif seq.grammar is not None and not seq.grammar.accept(token):
                reason = "abort"  # cannot happen for a correct grammar engine; ends this sequence only
            else:
                if stream is not None:
                    text += stream.push(token)
                    if stream.stopped:
                        reason = "stop"
                if seq.grammar is not None and seq.grammar.finished:
                    reason = "stop"  # the output is complete: only EOS could follow
            if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            if stream is not None:
                text += stream.finish()
            self._finish(seq, reason)
        return SequenceDelta(seq.request_id, seq.index, kept, text, reason, num_prompt_tokens=seq.num_prompt_tokens,
                             num_cached_tokens=max(seq.num_cached_tokens, 0))

    @staticmethod
    def _release_grammar(seq: Sequence) -> None:
        if seq.grammar is not None:
            seq.grammar.close()
            seq.grammar = None

    def _propose(self) -> None:
        """Drafts for every running sequence in decode, from its prediction if it has one and
        the prediction offers drafts, else from the proposer (if any), whose sampling speculation
        keeps exact:
        no penalties (they would change between drafts), no token constraints (logit_bias,
        allowed_token_ids, bad_words: verification does not apply them), no grammar (its mask would
        have to follow each draft), no logprobs, min_tokens reached, not pooling; none while more sequences run
        than `speculative_disable_by_batch_size` (a batch that large already reads each weight once
        for many tokens, so drafts cost more than they save; a draft model catches up on the tokens
        it missed when it drafts again)."""
        limit = self.args.speculative_disable_by_batch_size
        if limit is not None and len(self.scheduler.running) > limit:
            return
        candidates, budgets, predicted, predicted_budgets = [], [], [], []
        for seq in self.scheduler.running:
            p = seq.params
            if seq.grammar is not None:
                if not self._told_no_drafts:
                    log.info("speculative decoding: constrained (structured-output) sequences get no drafts")
                    self._told_no_drafts = True
                continue
            if (seq.num_tokens - seq.num_computed_tokens != 1 or p.pooling is not None or p.uses_penalties
                    or p.logprobs is not None or seq.num_output_tokens < p.min_tokens or p.uses_token_constraints):
                continue
            k = min(self.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k > 0 and p.prediction_token_ids:
                predicted.append(seq)
                predicted_budgets.append(k)
            elif k > 0 and self.proposer is not None:
                candidates.append(seq)
                budgets.append(k)
        if predicted:
            proposals = self.predictions.propose(predicted, predicted_budgets)
            for seq, k, proposal in zip(predicted, predicted_budgets, proposals, strict=True):
                if proposal.tokens:
                    seq.draft = proposal
                    self._predicted.add(seq)
                elif self.proposer is not None:
                    candidates.append(seq)
                    budgets.append(k)
        if candidates:
            assert self.proposer is not None
            for seq, proposal in zip(candidates, self.proposer.propose(candidates, budgets), strict=True):
                seq.draft = proposal if proposal.tokens else None

    def _release_drafter(self, seq: Sequence) -> None:
        """Forgets a sequence that finished or was preempted in every proposer."""
        self.predictions.release(seq)
        self._predicted.discard(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._release_grammar(seq)
        self.runner.release(seq)
        self._release_drafter(seq)
        group = self._groups[seq.request_id]
        if all(s.finished for s in group.sequences):
            del self._groups[seq.request_id]
            self._finished.append(seq.request_id)
