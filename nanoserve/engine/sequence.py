"""The state of one sequence in the engine (a request with n > 1 is n sequences)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.kv.manager import BlockTable

if TYPE_CHECKING:
    from nanoserve.engine.structured import GrammarMatcher


class Draft(Protocol):
    """Draft tokens a proposer suggested for a sequence, verified in the sequence's next step. The
    implementation (`spec_decode.Proposal`) also holds what verification needs of the proposer (the
    distributions the drafts were drawn from); this side knows only the tokens."""

    @property
    def tokens(self) -> list[int]: ...

    def truncate(self, n: int) -> Draft:
        """The first n drafts (1 <= n <= len(tokens)), as a new draft."""
        ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence. Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `0 <= num_computed_tokens <= len(all_token_ids)` (tokens whose K/V are in the cache); the
    next token is sampled when a step computes up to the last token. Draft tokens are not part of
    `all_token_ids`: a step that schedules them computes all_token_ids[-1:] + draft.tokens.
    `draft` is None or holds at least one token; the scheduler cuts it to the step's budget
    (`Draft.truncate`) and drops it once the step that verifies it has run, or on preemption.
    `grammar` is the matcher of a constrained sequence (None otherwise, and once it has ended): its
    state is always that after `output_token_ids`. A constrained sequence gets it before it enters
    the scheduler (its constraint compiled), so a scheduled one never lacks it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    index: int = 0  # which of the request's n samples
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_drafts_proposed: int = 0  # draft tokens verified, over the sequence's life
    num_drafts_accepted: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    wait_for: Sequence | None = None  # a sibling whose prompt blocks this one should reuse
    draft: Draft | None = None  # drafts to verify in the next step
    grammar: GrammarMatcher | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft.tokens)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether this sequence computes its prompt's logprobs: the first sample of a request that
        asked for them, until its first token (preemption later recomputes no logprobs)."""
        return self.params.prompt_logprobs is not None and self.index == 0 and not self.output_token_ids

    @property
    def needs_every_prompt_row(self) -> bool:
        """Whether every prompt row must be computed (no prefix-cache match): for its prompt
        logprobs, or for a mean-pooled embedding."""
        pooling = self.params.pooling
        return self.needs_prompt_logprobs or (pooling is not None and pooling.method == "mean")

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
