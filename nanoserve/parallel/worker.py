"""The worker ranks: processes that each hold one shard of the model and its KV pool, and run the
forward pass of every step rank 0 broadcasts (`step_broadcast`), joining its all-reduces.

Started by rank 0's engine build (`WorkerRanks.start`) for the ranks of its node, or by a command on
node-rank > 0 (`run_node_workers`) for that node's ranks; each runs `python -m nanoserve.parallel`,
given the engine arguments as JSON and where the ranks meet. A worker
ends when rank 0 sends a stop (exit 0) or when a collective fails (rank 0 or another rank is gone:
exit 1), so none outlives its engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch

from nanoserve.attention import select_backend
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.kv_memory import zeroed_pool
from nanoserve.model import load_model
from nanoserve.model.layer_ops import select_layer_ops
from nanoserve.parallel.group import Rendezvous, TensorParallelGroup
from nanoserve.parallel.megatron import shard_model
from nanoserve.parallel.step_broadcast import receive_setup, receive_step

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long a stopped worker gets to exit before it is killed


def rank_device(device: str, rank: int, ranks_per_node: int) -> torch.device:
    """A rank's device: the CPU, or on CUDA the GPU of its index on its node."""
    dev = torch.device(device)
    return torch.device("cuda", rank % ranks_per_node) if dev.type == "cuda" else dev


def run_worker(args: EngineArgs, rendezvous: Rendezvous, rank: int) -> None:
    """Loads and shards the model, joins the group, then runs steps until rank 0's stop."""
    per_node = args.tensor_parallel_size // args.nnodes
    device = rank_device(args.device, rank, per_node)
    if device.type == "cpu":  # the node's cores are shared by its ranks
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // per_node))
    else:
        torch.cuda.set_device(device)
    loaded = load_model(args.model, dtype=args.dtype, device=device)
    loaded.model.ops = select_layer_ops(args.attention_backend, device, loaded.model.dtype)
    group = TensorParallelGroup(rendezvous, rank, device, args.distributed_timeout)
    model = shard_model(loaded.model, group)
    del loaded
    setup = receive_setup(group)
    if setup.context:
        model.use_context(setup.context)
    cfg = model.cfg
    kv_cache = zeroed_pool((cfg.num_hidden_layers, 2, setup.num_blocks, setup.block_size, cfg.num_key_value_heads,
                            cfg.head_dim), model.dtype, device)
    backend = select_backend(args.attention_backend, device)
    log.info("tensor-parallel rank %d of %d ready (%s, %d KV blocks)", rank, group.world_size, device,
             setup.num_blocks)
    while (step := receive_step(group, setup.block_size)) is not None:
        hidden = model(step.input_ids, step.positions, kv_cache, step.meta, backend)
        model.compute_logits(hidden[step.logits_rows])


class WorkerRanks:
    """The worker processes one node started, by rank. Invariants: `stop` leaves none running,
    and none outlives this object (those still running when it is collected, or at interpreter
    exit, are killed: so a build that fails after starting them leaves none behind)."""

    def __init__(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        self.processes = processes
        weakref.finalize(self, _kill, list(processes.values()))

    @classmethod
    def start(cls, args: EngineArgs, rendezvous: Rendezvous, ranks: range) -> WorkerRanks:
        """Starts one worker process per rank of `ranks`, at the current log level."""
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        config = json.dumps(dataclasses.asdict(args))
        # The workers import the nanoserve this process runs, wherever it was imported from.
        source = str(Path(__file__).resolve().parents[2])  # the folder that holds nanoserve/
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (source, os.environ.get("PYTHONPATH"))))}
        processes = {
            rank: subprocess.Popen([sys.executable, "-m", "nanoserve.parallel", "--rank", str(rank),
                                    "--master-addr", rendezvous.master_addr, "--master-port",
                                    str(rendezvous.master_port), "--log-level", level, "--engine-args", config],
                                   env=env)
            for rank in ranks}
        return cls(processes)

    def dead(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first of these workers that has exited, or None."""
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                return rank, code
        return None

    def wait_dead(self, timeout: float) -> tuple[int, int] | None:
        """`dead()`, after waiting up to `timeout` seconds for a worker to exit."""
        deadline = time.monotonic() + timeout
        while (found := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return found

    def stop(self, grace_s: float = STOP_TIMEOUT_S) -> None:
        """Waits up to `grace_s` for the workers to exit (after a stop message), then kills those
        that have not."""
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _kill(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def node_ranks(args: EngineArgs) -> range:
    """The worker ranks of this node: all of its ranks but rank 0, which is the engine itself."""
    per_node = args.tensor_parallel_size // args.nnodes
    return range(max(1, args.node_rank * per_node), (args.node_rank + 1) * per_node)


def run_node_workers(args: EngineArgs) -> int:
    """A node of rank > 0: runs its worker ranks until they end; the first non-zero exit code."""
    workers = WorkerRanks.start(args, Rendezvous.from_env(args.tensor_parallel_size, args.nnodes), node_ranks(args))
    codes = [process.wait() for process in workers.processes.values()]
    return next((code for code in codes if code), 0)
