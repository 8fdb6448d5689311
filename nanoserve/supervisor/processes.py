"""Child processes of a supervisor (the data-parallel supervisor): started in a session of their
own, optionally pinned to cores, killed with their parent; waited for until ready; stopped with
SIGTERM, then SIGKILL."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import httpx

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def spawn(cmd: list[str], cpus: tuple[int, ...] | None = None,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Starts `cmd` in a session of its own, pinned to `cpus` with as many OpenMP threads (None:
    unpinned), with `extra_env` added to this process's environment, to receive SIGTERM if this
    process dies (Linux)."""
    env = {**os.environ, **(extra_env or {})}
    if cpus is not None:
        env["OMP_NUM_THREADS"] = str(len(cpus))
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_child_setup(cpus))


def _child_setup(cpus: tuple[int, ...] | None) -> Callable[[], None]:
    """What a child runs between fork and exec: its CPU pinning and its parent-death signal (libc
    is loaded here, before the fork)."""
    libc = ctypes.CDLL(None) if sys.platform == "linux" else None

    def setup() -> None:
        if cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return setup


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the supervisor was still starting things."""


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, timeout_s: float,
               stopping: threading.Event) -> None:
    """Polls `ready` until it is true; RuntimeError if `proc` exits or `timeout_s` passes first,
    Interrupted once `stopping` is set. A transport error counts as not ready (not listening yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping.is_set():
            raise Interrupted
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.TransportError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")
        stopping.wait(0.2)


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM to each process still running, then SIGKILL to those not gone within `timeout_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s; killing it", p.pid, timeout_s)
            p.kill()
            p.wait()
