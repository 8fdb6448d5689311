"""Work on a request's text that could hold the server's interpreter lock for long (a chat template's
rendering, tokenizing a long prompt) done in worker processes, each under a deadline and a memory
limit.

A `PromptPool` keeps `size` worker processes (fresh interpreters that import the tokenizer package
only, not torch), each with its own copy of the tokenizer; a call takes
a free worker, sends it a `Tokenizer` method name and its arguments, and waits for the reply on a
thread of the default executor (which waits in `poll`, releasing the lock). A worker that passes its
deadline is killed and replaced, and the call raises `PromptWorkError`; so does one that dies (e.g.
of its memory limit, `RLIMIT_AS`). Errors the method raises come back as the same kind (a
`ValueError` stays a `ValueError`: a chat template's failure is the request's fault).

Invariants: a worker serves one call at a time; every call ends (result, error or deadline), and a
worker that did not answer in time is never handed out again; the pool holds exactly `size` workers
between calls until `close`, which ends them all. Separate pools (templates, plain tokenizing) keep
one kind of work from starving the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.tokenizer.tokenizer import Tokenizer

from nanoserve.tokenizer.prompt_limits import PromptLimits

log = logging.getLogger(__name__)

_OPERATIONS = frozenset({"encode", "encode_chat"})  # the Tokenizer methods a pool runs


class PromptWorkError(ValueError):
    """The work passed its deadline or its worker died (its memory limit, a crash); the message
    says which, for the client."""


class _Worker:
    """One worker process (`python -m nanoserve.tokenizer.prompt_pool FD MEMORY`: a fresh interpreter
    that imports only the tokenizer package), and its end of a socket pair."""

    def __init__(self, tokenizer: Tokenizer, limits: PromptLimits, name: str) -> None:
        self.name = name
        ours, theirs = socket.socketpair()
        memory = "none" if limits.memory_bytes is None else str(limits.memory_bytes)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), memory],
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(tokenizer)

    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float) -> Any:
        """Runs one call; raises PromptWorkError (the worker is then dead) on a deadline or a death."""
        try:
            self.conn.send((op, args, kwargs))
            if not self.conn.poll(timeout_s):
                self.kill()
                raise PromptWorkError(f"the request's text took more than {timeout_s:g} s to prepare "
                                      "(chat template or tokenizer); it was stopped")
            ok, value = self.conn.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise PromptWorkError("preparing the request's text exhausted its worker (memory limit?); "
                                  "it was stopped") from e
        if not ok:
            kind, message = value
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return value

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        try:
            self.process.wait(2)
        except subprocess.TimeoutExpired:
            self.kill()


class PromptPool:
    def __init__(self, tokenizer: Tokenizer, size: int, limits: PromptLimits, name: str) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.name = name
        self._workers = [_Worker(tokenizer, limits, f"{name}-{i}") for i in range(size)]
        self._free: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in self._workers:
            self._free.put_nowait(w)

    @property
    def size(self) -> int:
        return len(self._workers)

    async def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """`tokenizer.<op>(*args, **kwargs)` in a worker, within the pool's deadline. Raises what the
        method raised (ValueError for bad input), or PromptWorkError."""
        if op not in _OPERATIONS:
            raise ValueError(f"not a tokenizer operation of the pool: {op}")
        worker = await self._free.get()
        try:
            return await asyncio.to_thread(worker.call, op, args, kwargs, self.limits.timeout_s)
        finally:
            if not worker.alive:
                log.warning("%s: a worker was stopped (deadline or death); starting another", self.name)
                worker = await asyncio.to_thread(self._replace, worker)
            self._free.put_nowait(worker)

    def _replace(self, dead: _Worker) -> _Worker:
        fresh = _Worker(self.tokenizer, self.limits, dead.name)
        self._workers[self._workers.index(dead)] = fresh
        return fresh

    def close(self) -> None:
        for w in self._workers:
            w.stop()


def _serve(conn: Connection, memory_bytes: int | None) -> None:
    """A worker's loop: the tokenizer first, then one call at a time until None (or the socket
    closes)."""
    if memory_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    tokenizer: Tokenizer = conn.recv()
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        op, args, kwargs = message
        try:
            reply: tuple[bool, Any] = (True, getattr(tokenizer, op)(*args, **kwargs))
        except ValueError as e:
            reply = (False, ("ValueError", str(e)))
        except MemoryError:
            reply = (False, ("ValueError", "preparing the request's text exceeded its worker's memory limit"))
        except Exception as e:  # a tokenizer or template bug: the request fails, the worker goes on
            reply = (False, ("RuntimeError", f"{type(e).__name__}: {e}"))
        conn.send(reply)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])), None if sys.argv[2] == "none" else int(sys.argv[2]))
