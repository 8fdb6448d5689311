"""Rank 0 of a tensor-parallel engine: the model runner over shard 0, which broadcasts each step's
batch to the worker ranks before running its own share of the forward pass.

Everything else of the engine (scheduler, KV manager and prefix cache, sampler, speculative
decoding's proposers) is rank 0's alone and unchanged: block ids mean the same on every rank, and
the logits rank 0 samples from are whole (gathered over the vocab shards).

Failure: a step that raises, on any rank, leaves the ranks' collectives out of step, so the
runner is dead after it: that step and every later one raise `RunnerFailure`, naming the rank that
died when it is one of this node's workers (checked before each step, and after a failed
collective). A dead peer fails the next collective at once (gloo sees the closed connection); a
stuck one after `distributed_timeout` seconds.
"""

from __future__ import annotations

import logging
import weakref

import torch

from nanoserve.attention import AttentionBackend
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.batch import PreparedBatch, prepare_batch
from nanoserve.engine.model_protocol import KVShape
from nanoserve.engine.model_runner import ModelRunner, RunnerFailure
from nanoserve.engine.pooling import Pooled
from nanoserve.engine.scheduler import StepPlan
from nanoserve.model import LoadedModel
from nanoserve.parallel.group import Rendezvous, TensorParallelGroup
from nanoserve.parallel.megatron import TensorParallelCausalLM, shard_model
from nanoserve.parallel.step_broadcast import Setup, send_setup, send_step, send_stop
from nanoserve.parallel.worker import WorkerRanks, node_ranks

log = logging.getLogger(__name__)

DEATH_GRACE_S = 1.0  # after a failed collective, how long to wait for a dead worker's exit to show


class TensorParallelLaunch:
    """Rank 0's side of starting the ranks: the rendezvous, and this node's worker processes,
    started before rank 0 loads its model so that every rank loads at once."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.rendezvous = Rendezvous.from_env(args.tensor_parallel_size, args.nnodes)
        self.workers = WorkerRanks.start(args, self.rendezvous, node_ranks(args))

    def shard(self, loaded: LoadedModel, device: torch.device) -> LoadedModel:
        """Joins the group (waiting for every rank) and swaps the loaded model for shard 0; the
        config stays the whole model's."""
        try:
            group = TensorParallelGroup(self.rendezvous, 0, device, self.args.distributed_timeout,
                                        self._workers_alive)
            shard = shard_model(loaded.model, group)
        except BaseException:
            self.workers.stop()  # a worker fails the same way, or is left waiting for rank 0
            raise
        log.info("tensor parallel: %d ranks over %s; the native whole-decoder path and CUDA graphs are off",
                 group.world_size, group.backend)
        return loaded._replace(model=shard)


    def _workers_alive(self) -> None:
        if (dead := self.workers.dead()) is not None:
            raise RuntimeError(f"{_died(*dead)} before joining the group; its log says why")


class TensorParallelRunner(ModelRunner):
    """A `ModelRunner` over shard 0 whose forward pass is the group's (see the module docstring).
    `failure` is None while the group works, else why it does not; the workers are stopped when
    it fails, when the runner is closed, and at the latest when it is collected or the
    interpreter exits."""

    model: TensorParallelCausalLM

    def __init__(self, model: TensorParallelCausalLM, workers: WorkerRanks, kv_shape: KVShape, num_blocks: int,
                 block_size: int, vocab_size: int, stop_token_ids: frozenset[int], device: torch.device,
                 backend: AttentionBackend | None = None) -> None:
        """Tells the workers the pool's size, so that they allocate theirs, and the context the
        model serves."""
        super().__init__(model, kv_shape, num_blocks, block_size, vocab_size, stop_token_ids, device, backend)
        self.group = model.group
        self.workers = workers
        self.failure: str | None = None
        send_setup(self.group, Setup(num_blocks, block_size, model.context or 0))
        self._stop_workers = weakref.finalize(self, _stop_workers, self.group, workers)

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, PreparedBatch, Pooled]:
        if self.failure is None and (dead := self.workers.dead()) is not None:
            self._fail(_died(*dead))
        if self.failure is not None:
            raise RunnerFailure(self.failure)
        batch = prepare_batch(plan, self.block_size, self.device)
        try:
            send_step(self.group, batch)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta, self.backend)
            logits = self.model.compute_logits(hidden[batch.logits_rows])
        except Exception as e:
            dead = self.workers.wait_dead(DEATH_GRACE_S)
            why = _died(*dead) if dead is not None else f"a tensor-parallel step failed: {e}"
            self._fail(why)
            raise RunnerFailure(why) from e
        return logits, batch, self.pooler.pool(hidden, batch.pooled) if batch.pooled else ()

    def close(self) -> None:
        """Stops the workers (idempotent): a stop message while the group works, then each one's exit."""
        self._stop_workers()

    def _fail(self, why: str) -> None:
        """Records the failure and ends the workers still running: the group is broken for good."""
        log.error("%s; the engine is dead", why)
        self.failure = why
        self.workers.stop(grace_s=0.0)


def _stop_workers(group: TensorParallelGroup, workers: WorkerRanks) -> None:
    if workers.dead() is None:
        try:
            send_stop(group)
        except RuntimeError:
            log.warning("could not send the workers a stop; ending them")
    workers.stop()


def _died(rank: int, code: int) -> str:
    return f"tensor-parallel rank {rank} died (exit code {code})"
