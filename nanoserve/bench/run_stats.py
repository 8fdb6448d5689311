"""The counters of one benchmark run (`RunStats`), shared by nanoserve's runs and the peers'; every
rate is derived from the counters, never stored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RunStats:
    """Counters of one run; rates are derived. `decode_*` cover the pure-decode steps only."""

    label: str
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads): near elapsed_s on an idle machine, 1 thread
    steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    # K/V positions the pure-decode steps attended: each running sequence's length, summed over
    # the steps (0 where a run does not count them: the peers).
    decode_context_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in steps where no sequence decodes
    prefill_s: float = 0.0
    peak_running: int = 0
    preemptions: int = 0
    # Per request: seconds from being handed to the engine to its first and to its last token.
    latencies: list[tuple[float, float]] = field(default_factory=list)

    @staticmethod
    def _rate(count: float, seconds: float) -> float:
        return count / seconds if seconds > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self._rate(self.requests, self.elapsed_s)

    @property
    def output_tokens_per_s(self) -> float:
        return self._rate(self.output_tokens, self.elapsed_s)

    @property
    def total_tokens_per_s(self) -> float:
        return self._rate(self.prompt_tokens + self.output_tokens, self.elapsed_s)

    @property
    def steps_per_s(self) -> float:
        return self._rate(self.steps, self.elapsed_s)

    @property
    def decode_tokens_per_s(self) -> float:
        return self._rate(self.decode_tokens, self.decode_s)

    @property
    def decode_steps_per_s(self) -> float:
        return self._rate(self.decode_steps, self.decode_s)

    @property
    def decode_context_tokens_per_s(self) -> float:
        return self._rate(self.decode_context_tokens, self.decode_s)

    @property
    def decode_batch(self) -> float:
        """Mean sequences per pure-decode step."""
        return self._rate(self.decode_tokens, self.decode_steps)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._rate(self.prefill_tokens, self.prefill_s)

    def to_dict(self) -> dict[str, Any]:
        rates = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "steps_per_s",
                 "decode_tokens_per_s", "decode_steps_per_s", "decode_context_tokens_per_s", "decode_batch",
                 "prefill_tokens_per_s")
        return {**dataclasses.asdict(self), **{name: getattr(self, name) for name in rates}}
