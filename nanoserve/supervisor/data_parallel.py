"""`nanoserve serve --data-parallel-size N`: N replicas of `nanoserve serve` behind sglang-router,
started, watched and stopped by one process (the supervisor).

Layout (`DataParallelPlan`): the router answers on the user's host:port; replica i on
127.0.0.1:port+1+i; the router's own Prometheus metrics on host:port+N+1. Cores: the supervisor's
CPU affinity is split into N contiguous groups, one per replica, each replica pinned to its group
and running that many torch threads (OMP_NUM_THREADS), so replicas never compete for a core
(with fewer cores than replicas, each gets one core, shared round-robin).

Lifecycle (`serve_data_parallel`): the replicas start; the router starts once every replica
answers /health with 200 and the supervisor returns to waiting once the router has them all. On
SIGINT or SIGTERM the router stops first (no new requests), then the replicas, which finish their
in-flight requests within their own shutdown timeout. A replica that dies is logged and left out
by the router's health checks, the others keep serving; the death of the router, or of every
replica, ends the supervisor (exit status 1). Every child runs in a session of its own (a terminal's
Ctrl-C reaches the supervisor only) and, on Linux, gets SIGTERM should the supervisor die
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

import httpx

from nanoserve.supervisor.processes import Interrupted, spawn, stop, wait_until
from nanoserve.supervisor.router import RouterConfig

log = logging.getLogger(__name__)

REPLICA_HOST = "127.0.0.1"


def split_cpus(cpus: Sequence[int], n: int) -> tuple[tuple[int, ...], ...]:
    """`cpus` in n contiguous groups whose sizes differ by at most one; with fewer cpus than n,
    one cpu per group, the cpus reused in turn. Invariant: every group is non-empty."""
    if n < 1:
        raise ValueError(f"the data-parallel size must be at least 1, got {n}")
    if not cpus:
        raise ValueError("no CPU to run replicas on")
    if len(cpus) < n:
        return tuple((cpus[i % len(cpus)],) for i in range(n))
    base, extra = divmod(len(cpus), n)
    groups, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        groups.append(tuple(cpus[start:start + size]))
        start += size
    return tuple(groups)


def available_cpus() -> list[int]:
    """The cpus this process may run on (its affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class DataParallelPlan:
    """Where everything listens and runs. Invariants: size >= 1; len(cpus) == size; every port
    from port to port + size + 1 is a valid TCP port."""

    host: str
    port: int
    size: int
    policy: str
    cpus: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {self.size}")
        if len(self.cpus) != self.size:
            raise ValueError(f"{self.size} replicas need {self.size} cpu groups, got {len(self.cpus)}")
        if self.port < 1:
            raise ValueError(f"--data-parallel-size needs a port of 1 or more (the replicas take the ports after it), "
                             f"got --port {self.port}")
        if self.metrics_port > 65535:
            raise ValueError(f"--port {self.port} with {self.size} replicas needs ports {self.port} to "
                             f"{self.metrics_port}; pick a port at most {65535 - self.size - 1}")

    @classmethod
    def for_cpus(cls, host: str, port: int, size: int, policy: str, cpus: Sequence[int]) -> DataParallelPlan:
        return cls(host, port, size, policy, split_cpus(cpus, size))

    @property
    def replica_ports(self) -> tuple[int, ...]:
        return tuple(range(self.port + 1, self.port + 1 + self.size))

    @property
    def replica_urls(self) -> tuple[str, ...]:
        return tuple(f"http://{REPLICA_HOST}:{p}" for p in self.replica_ports)

    @property
    def local_url(self) -> str:
        """The router's URL from this machine (a wildcard host reached through loopback)."""
        host = {"0.0.0.0": REPLICA_HOST, "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        return self.port + self.size + 1

    def check_ports_free(self) -> None:
        """ValueError naming the first port of the layout that something already listens on
        (bound as the servers bind, with SO_REUSEADDR: a closed connection's TIME_WAIT is no owner)."""
        wanted = [(self.host, self.port), *((REPLICA_HOST, p) for p in self.replica_ports),
                  (self.host, self.metrics_port)]
        for host, port in wanted:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError as e:
                    raise ValueError(f"port {port} on {host} is not free ({e.strerror}); with --data-parallel-size "
                                     f"{self.size} the router, replicas and router metrics use ports {self.port} "
                                     f"to {self.metrics_port}: pick another --port") from e


def free_port_range(span: int, attempts: int = 100) -> int:
    """The first of `span` consecutive loopback ports that nothing listens on now (a layout for
    `--port`), tried from random starts in [20000, 60000); RuntimeError after `attempts` tries."""
    for _ in range(attempts):
        start = random.randint(20000, 60000 - span)
        try:
            for port in range(start, start + span):
                with socket.socket() as s:
                    s.bind((REPLICA_HOST, port))
        except OSError:
            continue
        return start
    raise RuntimeError(f"no {span} consecutive free loopback ports found")


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 (its model is loaded)."""
    return httpx.get(f"{url}/health", timeout=5).status_code == 200


def router_has(url: str, workers: Sequence[str], api_key: str | None) -> bool:
    """Whether the router at `url` lists every worker of `workers` as healthy (its /workers, which
    answers 200 from the start, unlike /readiness, whose 503s it logs as errors)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    listed = httpx.get(f"{url}/workers", headers=headers, timeout=5).json().get("workers", [])
    return {w.get("url") for w in listed if w.get("is_healthy")} >= set(workers)


def serve_data_parallel(plan: DataParallelPlan, replica_command: Callable[[str, int], list[str]],
                        shutdown_timeout_s: float, log_level: str, api_key: str | None = None,
                        load_timeout_s: float = 1800.0) -> int:
    """Runs the plan until SIGINT/SIGTERM (see the module docstring); `replica_command(host, port)`
    is the command line of one replica; `api_key` is the replicas' (the router checks it too).
    Returns the exit status: 0 after a signal, 1 when a replica fails to load or the router fails."""
    plan.check_ports_free()
    if log_level != "DEBUG":  # one line per health poll otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    stopping = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    replicas: list[subprocess.Popen[bytes]] = []
    router: subprocess.Popen[bytes] | None = None
    try:
        for port, cpus in zip(plan.replica_ports, plan.cpus, strict=True):
            replicas.append(spawn(replica_command(REPLICA_HOST, port), cpus))
            log.info("replica %d: http://%s:%d, pid %d, cpus %s", len(replicas) - 1, REPLICA_HOST, port,
                     replicas[-1].pid, ",".join(map(str, cpus)))
        for i, (url, proc) in enumerate(zip(plan.replica_urls, replicas, strict=True)):
            wait_until(functools.partial(healthy, url), proc, f"replica {i} ({url})", load_timeout_s, stopping)
        config = RouterConfig(plan.host, plan.port, plan.metrics_port, plan.replica_urls, plan.policy,
                              shutdown_timeout_s, log_level, api_key)
        router = spawn(config.command(), extra_env=config.env())
        wait_until(functools.partial(router_has, plan.local_url, plan.replica_urls, api_key), router, "the router",
                   60, stopping)
        log.info("serving %d replicas behind sglang-router (%s) on http://%s:%d (router pid %d)", plan.size,
                 plan.policy, plan.host, plan.port, router.pid)
        return supervise(router, replicas, stopping)
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    except Interrupted:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if router is not None:
            stop([router], shutdown_timeout_s + 5)
        stop(replicas, shutdown_timeout_s + 5)


def supervise(router: subprocess.Popen[bytes], replicas: list[subprocess.Popen[bytes]],
               stopping: threading.Event) -> int:
    """Waits for a signal (0), or the death of the router or of every replica (1), logging each
    replica that dies."""
    reported: set[int] = set()
    while not stopping.wait(0.5):
        if router.poll() is not None:
            log.error("the router exited with status %d; stopping the replicas", router.returncode)
            return 1
        for i, proc in enumerate(replicas):
            if proc.poll() is not None and i not in reported:
                reported.add(i)
                log.warning("replica %d (pid %d) exited with status %d; the router routes around it", i, proc.pid,
                            proc.returncode)
        if len(reported) == len(replicas):
            log.error("every replica has exited; stopping the router")
            return 1
    log.info("stopping the router, then the replicas")
    return 0
