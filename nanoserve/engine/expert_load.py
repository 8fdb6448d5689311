"""Expert load of a mixture-of-experts model (Shazeer et al., 2017: "load" = tokens per expert):
what each step routed where, and what that cost in weight reads.

At decode the bytes a step reads grow with the number of distinct experts its tokens chose, not with
its tokens: an expert chosen by one token or by sixty-four is streamed once (`LayerOps.moe_ffn`).
`ExpertMeter` turns the model's per-step counts (`CausalLM.take_expert_load`: tokens per expert per
MoE layer) into a step's figures (`StepExperts`) and the running counters a front end publishes
(`ExpertStats`). Invariants: a step's counts are read once and folded into the counters exactly
once; nothing here runs for a dense model (the engine builds no meter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(slots=True)
class ExpertStats:
    """Counters since the engine was built, over its `num_layers` MoE layers of `num_experts`
    experts each. `expert_reads`: distinct experts chosen, per layer, summed over layers and steps
    (each one expert's matrices streamed once); `expert_read_bytes`: their weight bytes;
    `routed_tokens`: (token, expert) choices, summed over layers and steps; `steps`: steps that ran
    the model. `last_experts_read` and `last_busiest_share`: the latest step's distinct experts
    (summed over layers) and the largest fraction of its tokens any one expert of any layer took."""

    num_layers: int
    num_experts: int
    steps: int = 0
    expert_reads: int = 0
    expert_read_bytes: int = 0
    routed_tokens: int = 0
    last_experts_read: int = 0
    last_busiest_share: float = 0.0


class StepExperts(NamedTuple):
    """One step's expert load: `experts_read` distinct experts summed over the MoE layers,
    `busiest_tokens` the most tokens one expert of one layer received, and `tokens_per_expert`
    [E] the tokens each expert received, summed over the layers."""

    experts_read: int
    busiest_tokens: int
    tokens_per_expert: torch.Tensor


class ExpertMeter:
    """Folds each step's expert counts into `stats`. `expert_bytes[l]`: the weight bytes of one
    expert of MoE layer l (`SparseMoE.expert_bytes`)."""

    def __init__(self, expert_bytes: list[int], num_experts: int) -> None:
        if not expert_bytes:
            raise ValueError("an expert meter needs at least one mixture-of-experts layer")
        self._bytes = torch.tensor(expert_bytes, dtype=torch.int64)
        self.stats = ExpertStats(num_layers=len(expert_bytes), num_experts=num_experts)

    def step(self, load: torch.Tensor, num_tokens: int) -> StepExperts:
        """The figures of a step of `num_tokens` tokens whose counts are `load` [layers, E] (int64,
        CPU), folded into `stats`. Vectorised: a few reductions over [layers, E], no per-token work."""
        if load.shape != (self.stats.num_layers, self.stats.num_experts):
            raise ValueError(f"expert load of shape {tuple(load.shape)}, expected "
                             f"{(self.stats.num_layers, self.stats.num_experts)}")
        chosen = load > 0
        per_layer = chosen.sum(dim=1)
        read = int(per_layer.sum())
        busiest = int(load.max())
        s = self.stats
        s.steps += 1
        s.expert_reads += read
        s.expert_read_bytes += int((per_layer * self._bytes).sum())
        s.routed_tokens += int(load.sum())
        s.last_experts_read = read
        s.last_busiest_share = busiest / num_tokens if num_tokens else 0.0
        return StepExperts(read, busiest, load.sum(dim=0))
