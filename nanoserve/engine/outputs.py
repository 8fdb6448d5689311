"""Every type that leaves the engine: what a step produced, what a request completed to, the
engine's state for a front end, and the limits a request is validated against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from nanoserve.engine.expert_load import ExpertStats
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import SpecStats
from nanoserve.kv.manager import KVStats, blocks_needed
from nanoserve.model.checkpoint.pooling import PoolingConfig

__all__ = ["CompletionOutput", "EngineLimits", "EngineSnapshot", "EngineStats", "ExpertStats", "KVStats",
           "PromptLogprob",
           "RequestOutput", "SequenceDelta", "SequenceProgress", "SequenceStats", "SpecStats", "StepOutput",
           "StepRecord"]


class PromptLogprob(NamedTuple):
    """One prompt token given the ones before it: its raw logprob, its rank in that distribution
    (1 = most likely), and the `prompt_logprobs` most likely (id, raw logprob), descending."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence produced in one step. `text` is final (never revised). The token that
    ended a sequence by EOS or a stop id is in `token_ids` but not in `text`. A pooling sequence
    has one delta: no tokens, its `embedding`, finish reason "stop"."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # With `prompt_logprobs`, in the first delta of the request's first sample only: one entry per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # Drafts from the request's `prediction` verified in this delta: accepted (and in token_ids),
    # and rejected (computed, not output).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One engine step: a delta per sequence that produced tokens or ended, and the ids of the
    requests whose last sequence ended in this step. Each request is reported in `finished`
    exactly once, in the step that carries its last delta; an aborted request never is (its end
    is the caller's own action). `failed`: request id -> why, for requests the engine dropped
    before they ran (a constraint that did not compile); such a request has no delta and is
    never in `finished`."""

    deltas: list[SequenceDelta]
    finished: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class SequenceProgress(NamedTuple):
    """One unfinished sequence: whether it runs (else it waits), its tokens, and how many of
    them are computed (their K/V in the pool)."""

    running: bool
    num_tokens: int
    num_computed_tokens: int


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples. `logprobs[i]` is the raw logprob of token_ids[i];
    `top_logprobs[i]` the (id, logprob) of the most likely tokens at that step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request of the offline API (`LLM`), folded from its deltas (`accumulate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PromptLogprob | None] | None = None  # see SequenceDelta
    embedding: list[float] | None = None  # of a pooling request, once it finished

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def accumulate(self, delta: SequenceDelta) -> None:
        """Folds one step's delta of one of this request's sequences into its output."""
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        out.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.logprobs is not None:
            if out.logprobs is None:
                out.logprobs, out.top_logprobs = [], []
            out.logprobs.extend(delta.logprobs)
            assert out.top_logprobs is not None
            out.top_logprobs.extend(delta.top_logprobs or [])


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state between two steps. `num_running`, `num_waiting`: requests, not
    sequences (a request runs while any of its sequences runs, and waits while none runs and one
    still waits); `num_waiting_seqs`: the sequences that wait, of every request (each of a
    request's n counts), which is what a front end bounds its queue by. `experts`: a mixture of
    experts' load counters (None for a dense model)."""

    num_running: int
    num_waiting: int
    num_waiting_seqs: int
    kv: KVStats
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats
    experts: ExpertStats | None = None


class StepRecord(NamedTuple):
    """The composition of one engine step that ran a batch. Its tokens: `decode_tokens` (one per
    decoding sequence) + `draft_tokens` (the drafts those sequences verified) + `prefill_tokens`
    (prompt chunks, and tokens recomputed after a preemption) <= `budget`
    (max_num_batched_tokens). `end` is time.monotonic when the step ended. A mixture of experts'
    step: `experts_read` distinct experts summed over its MoE layers, `busiest_expert_tokens` the
    most tokens one expert of one layer received (both 0 for a dense model)."""

    end: float
    duration_s: float
    num_seqs: int
    decode_tokens: int
    draft_tokens: int
    prefill_tokens: int
    budget: int
    preempted: int
    experts_read: int = 0
    busiest_expert_tokens: int = 0


class SequenceStats(NamedTuple):
    """One unfinished sequence's progress, for a live view: `computed_tokens` of its prompt +
    output tokens have their K/V in the pool (0 while it waits), `cached_tokens` of its prompt came
    from the prefix cache at its first admission (-1 before it)."""

    request_id: str
    seq_index: int  # which of the request's n samples
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int
    cached_tokens: int
    preemptions: int
    drafts_proposed: int
    drafts_accepted: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A record of the engine's insides for a live view (`LiveStats.record`), built only while
    someone watches.

    `block_states`: one `kv.BlockState` value per block id. `tree`: the prefix tree's first nodes
    breadth first, as (parent's position in `tree` or -1 for the root, blocks, locked), so the
    listed nodes form a connected top of the tree; `tree_nodes` counts all of them. `running` and
    `waiting` list sequences in scheduling order, each capped (`num_waiting_seqs` is the true
    count). `steps`: the steps since the previous record, oldest first (the most recent ones if
    more ran than the ring holds). `snapshot`: the counters (tokens, prefix cache, speculation,
    experts). `expert_tokens`: a mixture of experts' tokens per expert, summed over its MoE layers
    and the recorded steps (None for a dense model)."""

    time: float
    block_size: int
    block_states: bytes
    tree: list[tuple[int, int, bool]]
    tree_nodes: int
    running: list[SequenceStats]
    waiting: list[SequenceStats]
    num_waiting_seqs: int
    steps: list[StepRecord]
    snapshot: EngineSnapshot
    num_preemptions: int
    max_num_seqs: int
    max_num_batched_tokens: int
    expert_tokens: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What decides whether a request can ever run, apart from the engine (a front end in another
    process validates with it before anything is queued). `reserve_blocks`: blocks every sequence
    takes whatever its length (the contiguous layout), else 0. `pooling`: how the model's
    embeddings are made (None: it makes none)."""

    max_model_len: int
    num_blocks: int
    block_size: int
    reserve_blocks: int
    vocab_size: int
    detokenizes: bool
    pooling: PoolingConfig | None = None

    @property
    def max_tokens_in_pool(self) -> int:
        """The most tokens one sequence can hold: the context length or the whole pool."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError, with the numbers, when a request can never run."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.pooling is not None:
            self.validate_pooling(params)
        total = len(prompt_ids) + (0 if params.pooling is not None else params.max_tokens)
        if total > self.max_model_len:
            asked = (f"{total} in the input" if params.pooling is not None
                     else f"{total} ({len(prompt_ids)} in the prompt + {params.max_tokens} max_tokens)")
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the request asks for {asked}")
        blocks = blocks_needed(total, self.block_size, self.reserve_blocks)
        if blocks > self.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks; the pool has {self.num_blocks}")
        if params.stop and not self.detokenizes:
            raise ValueError("stop strings need a tokenizer")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.allowed_token_ids or ()):
            raise ValueError(f"allowed_token_ids must be in [0, {self.vocab_size})")
        if params.bad_words and not self.detokenizes:
            raise ValueError("bad_words need a tokenizer")
        if params.prediction is not None and params.prediction_token_ids is None and not self.detokenizes:
            raise ValueError("prediction needs a tokenizer (or prediction_token_ids)")
        if any(not 0 <= t < self.vocab_size for t in params.prediction_token_ids or ()):
            raise ValueError(f"prediction token ids must be in [0, {self.vocab_size})")

    def validate_pooling(self, params: SamplingParams) -> None:
        """Raises ValueError unless the model makes embeddings the way `params.pooling` asks."""
        assert params.pooling is not None
        if self.pooling is None:
            raise ValueError("this model makes no embeddings")
        if params.pooling.dimensions is not None:
            self.pooling.check_dimensions(params.pooling.dimensions)
