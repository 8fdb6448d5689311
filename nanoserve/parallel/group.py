"""The process group of a tensor-parallel model: rendezvous and the three collectives Megatron-style
sharding needs (all-reduce, gather to rank 0, broadcast from rank 0).

Ranks meet torchrun's way: rank 0 hosts a `TCPStore` at MASTER_ADDR:MASTER_PORT and every rank
joins a gloo (CPU) or NCCL (CUDA) process group through it. The group is an object the model and
the runner hold, never torch.distributed's global default group, so an engine can be built, closed
and built again in one process (tests do).

Invariant: every rank calls the same collectives in the same order on tensors of the same shape
and dtype; a rank that stops doing so (it died, or raised mid-step) makes the others' next
collective fail, after `timeout` at the latest: the group is then unusable.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

JOIN_TIMEOUT = datetime.timedelta(minutes=10)
JOINED_KEY = "nanoserve/joined"  # counts the ranks other than 0 that have joined
GO_KEY = "nanoserve/go"  # set by rank 0 once every rank has
# A worker waits this long for rank 0's next step: as good as forever (an idle server sends
# none), since a rank 0 that dies closes its sockets, which ends the wait at once.
IDLE_WAIT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks meet: rank 0's store address and port, and the group's size."""

    master_addr: str
    master_port: int
    world_size: int

    @classmethod
    def from_env(cls, world_size: int, nnodes: int) -> Rendezvous:
        """MASTER_ADDR and MASTER_PORT as torchrun sets them; on one node they default to the
        loopback address and a free port. Several nodes need both set (the same on every node)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if nnodes > 1 and (addr is None or port is None):
            raise ValueError("tensor parallelism over several nodes needs MASTER_ADDR and MASTER_PORT set on each")
        return cls(addr or "127.0.0.1", int(port) if port else free_port(), world_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Collectives(Protocol):
    """The collectives of a c10d backend (ProcessGroupGloo, ProcessGroupNCCL) used here; torch binds
    them on every backend, but its type stubs declare them on ProcessGroup only."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: dist.GatherOptions) -> dist.Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> dist.Work: ...


class TensorParallelGroup:
    """One rank's handle on the group. `timeout` bounds every collective but the workers' wait
    for the next step (`broadcast(..., idle=True)`)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device, timeout_s: float,
                 peers_alive: Callable[[], None] | None = None) -> None:
        """Joins the group: blocks until all `world_size` ranks have, up to `JOIN_TIMEOUT` (ranks
        load their model first, some slower than others). Rank 0 counts the others in, calling
        `peers_alive` (which raises for a peer known to be gone) while it waits, then lets them
        go; only then does any rank set up the backend, whose own waits are bounded by `timeout_s`."""
        self.rank = rank
        self.world_size = rendezvous.world_size
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        join = max(self.timeout, JOIN_TIMEOUT)
        self._store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, self.world_size, rank == 0,
                                    timeout=join, wait_for_workers=False)
        if rank:  # then waits for rank 0's word that every rank is here, so that none waits long below
            self._store.add(JOINED_KEY, 1)
            self._store.wait([GO_KEY])
        else:
            deadline = time.monotonic() + join.total_seconds()
            while self._store.add(JOINED_KEY, 0) < self.world_size - 1:
                if peers_alive is not None:
                    peers_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks did not all join within {join}")
                time.sleep(0.05)
            self._store.set(GO_KEY, "1")
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            backend: object = dist.ProcessGroupNCCL(self._store, rank, self.world_size, options)
        else:
            backend = dist.ProcessGroupGloo(self._store, rank, self.world_size, self.timeout)
        self._group = cast(Collectives, backend)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place; returns it."""
        self._group.allreduce([t]).wait()
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """On rank 0, every rank's `t` [rows, cols] side by side: [rows, world_size * cols], rank
        0's first; None on the others."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == 0 else []
        self._group.gather([parts] if parts else [], [t.contiguous()], opts).wait()
        return torch.cat(parts, dim=-1) if parts else None

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape), in place; `idle` (a worker waiting for
        the next step) waits without a time limit."""
        self._group.broadcast(t, 0, IDLE_WAIT if idle else self.timeout).wait()
        return t
