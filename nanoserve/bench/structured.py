"""The per-step cost of structured output: decode steps of a batch of B sequences all constrained
by a JSON schema against the same batch unconstrained, side by side in one run.

Each measurement admits B requests (random prompt ids of one length), steps until every sequence
decodes, then times `steps` decode steps. Constrained and unconstrained runs alternate, and the
median step of each is kept, so that slow drift of the machine affects both alike. The schema is
an array of bounded strings long enough that no constrained sequence finishes while measured.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams, StructuredOutputs

SCHEMA: dict[str, Any] = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["name", "score"], "additionalProperties": False}}


@dataclass(frozen=True, slots=True)
class StepCost:
    batch: int
    free_ms: float  # median decode step, unconstrained
    constrained_ms: float  # median decode step, every sequence constrained

    @property
    def overhead(self) -> float:
        return self.constrained_ms / self.free_ms - 1


def _decode_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int, constrained: bool,
                  rng: random.Random) -> list[float]:
    structured = StructuredOutputs(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=0, ignore_eos=True, structured=structured)
    for i in range(batch):
        engine.add_request(f"{'c' if constrained else 'f'}{i}", [rng.randrange(engine.vocab_size)
                                                                 for _ in range(prompt_len)], params)
    while engine.num_decoding_seqs() < batch:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for i in range(batch):
        engine.abort(f"{'c' if constrained else 'f'}{i}")
    return times


def structured_step_costs(engine: LLMEngine, batch_sizes: tuple[int, ...], steps: int = 16, prompt_len: int = 32,
                          rounds: int = 3, seed: int = 0) -> list[StepCost]:
    """Median decode-step times per batch size, constrained and not (`rounds` alternations)."""
    rng = random.Random(seed)
    _decode_steps(engine, 2, prompt_len, 4, True, rng)  # warm-up: the grammar compiler and the first masks
    costs = []
    for batch in batch_sizes:
        free: list[float] = []
        constrained: list[float] = []
        for _ in range(rounds):
            free += _decode_steps(engine, batch, prompt_len, steps, False, rng)
            constrained += _decode_steps(engine, batch, prompt_len, steps, True, rng)
        costs.append(StepCost(batch, statistics.median(free) * 1e3, statistics.median(constrained) * 1e3))
    return costs


def format_costs(costs: list[StepCost]) -> str:
    lines = ["| batch | unconstrained step (ms) | JSON-schema step (ms) | overhead |", "|---|---|---|---|"]
    lines += [f"| {c.batch} | {c.free_ms:.2f} | {c.constrained_ms:.2f} | {c.overhead:+.1%} |" for c in costs]
    return "\n".join(lines)
