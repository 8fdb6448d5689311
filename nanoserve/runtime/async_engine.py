"""The front end of the engine core: what request handlers on the event loop use.

`AsyncEngine` runs the engine core (`nanoserve.runtime.engine_core`) on a thread of this process,
given a loader, or in a process of its own, given `EngineArgs`, and talks to it the same way in
both cases: commands go into a thread-safe queue (a forwarding thread writes them to the core's
pipe in the process case), and the core's messages come back through
`loop.call_soon_threadsafe` (from a reading thread in the process case). So everything on this
side, the request table, the admission counts, state changes, runs on the event loop and needs
no lock, and a handler never blocks on the core.

Stats: while at least one sink watches (`watch_stats`), the core sends an `EngineStats` record
a few times a second and this side hands each to every sink, and keeps the recent TTFT and ITL
samples (`latencies`); with no sink, the core records nothing for them.

Aborts happen between steps: an aborted request's blocks are free after the core's next
iteration. A core that exits, by a stop, an error or a crashed process, fails every stream still
open. A core process that dies after it had loaded is started again (the state goes DEAD, then
LOADING, then RUNNING), after a delay that doubles with each restart, at most `max_restarts` times
within `RESTART_WINDOW_S`; past that, or for a core that never loaded, `on_fatal` is called (a
server then exits, for its supervisor to restart it). A core on a thread is not restarted: its
engine object may be broken.

Stopping a core process that is still loading does not wait for its load: it is sent
`LOAD_CANCEL_SIGNAL`, which unwinds the load, and is killed if it has not exited
`LOAD_CANCEL_GRACE_S` later (a load stuck in a call that takes no signal); the state goes STOPPED.
A core on a thread loads to the end first.

Deltas are merged in one layer, here: the core sends every step's deltas as the engine made them,
and each `OutputStream` holds what arrived for it until its consumer takes it, merging per
sequence what piled up (`coalesce`). Only this side can merge for a consumer that fell behind, and
`stream_interval` is then the same mechanism (the consumer is woken every N steps instead of
every step), so the engine process spends nothing on either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import EngineSnapshot, EngineStats, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.runtime.defaults import DEFAULT_MAX_RESTARTS
from nanoserve.runtime.deltas import coalesce
from nanoserve.runtime.engine_core import (
    LOAD_CANCEL_SIGNAL,
    AbortRequest,
    AddRequest,
    Command,
    EngineInfo,
    EngineState,
    Exited,
    Message,
    Ready,
    Update,
    WatchStats,
    run_core,
    run_core_process,
)
from nanoserve.runtime.metrics import LatencyWindow, Metrics

log = logging.getLogger(__name__)

PROCESS_STOP_TIMEOUT_S = 30.0
LOAD_CANCEL_GRACE_S = 5.0  # a loading core process has this long to exit after LOAD_CANCEL_SIGNAL
RESTART_WINDOW_S = 600.0  # restarts counted against `max_restarts`: those this recent
RESTART_BACKOFF_S = 1.0  # the first restart's delay, doubled for each further one in the window
MAX_RESTART_BACKOFF_S = 30.0


class EngineError(RuntimeError):
    """The engine failed a request."""


class EngineUnavailableError(EngineError):
    """The engine is loading, dead or stopped and takes no request."""


class QueueFullError(RuntimeError):
    """`max_queued_requests` requests are already waiting."""


class AsyncEngine:
    """Owns the engine core. States: LOADING -> RUNNING -> STOPPED (stop) or DEAD (a broken
    engine or a dead process), and DEAD -> LOADING when a dead core process is restarted; LOADING
    -> DEAD when the loader raises. Requests are accepted only while RUNNING and while their
    sequences (n of them per prompt) fit in the queue: at most `max_queued_requests` sequences
    wait, counting those handed off but not yet seen by the core, so the waiting queue is bounded
    at every moment whatever each request's n."""

    def __init__(self, loader: Callable[[], LLMEngine] | EngineArgs, *, max_queued_requests: int = 1024,
                 metrics: Metrics | None = None, stream_interval: int = 1, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 on_fatal: Callable[[], None] | None = None,
                 on_ready: Callable[[EngineInfo], None] | None = None) -> None:
        """`loader`: run on a thread of this process, or `EngineArgs` to build the engine from in
        an engine-core process. `stream_interval`: a stream's consumer gets its outputs every
        this many steps (merged per sequence), and always at a request's first output and when
        a sequence finishes; more than 1 trades inter-token latency for fewer, larger chunks.
        `max_restarts`: restarts of a dead core process allowed within `RESTART_WINDOW_S`.
        `on_fatal` is called on the event loop when the engine will not serve again: the model
        never loaded, or the core died once more than its restarts allow; `on_ready` on the event
        loop when the engine starts serving (state RUNNING: /health answers 200), after each
        restart too."""
        if max_queued_requests < 1:
            raise ValueError("max_queued_requests must be at least 1")
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        if max_restarts < 0:
            raise ValueError("max_restarts must be at least 0")
        self.max_queued_requests = max_queued_requests
        self.stream_interval = stream_interval
        self.metrics = metrics
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.info: EngineInfo | None = None  # set once loaded
        self.snapshot: EngineSnapshot | None = None
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self._restarts: collections.deque[float] = collections.deque()  # times of restarts in the window
        self._restart_pending = False
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None  # the one stop's join
        self._load_cancelled = False  # the stop came while the core process was loading
        self._loader = loader
        self._on_fatal = on_fatal
        self._on_ready = on_ready
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # engine request id -> its API request's stream
        # Sequences of each AddRequest the core has not taken yet, in the order sent, and their sum.
        self._handed_off: collections.deque[int] = collections.deque()
        self._handed_off_seqs = 0
        self._waiting = 0  # sequences waiting in the core, as of its last update
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._process: BaseProcess | None = None
        self._stats_sinks: list[Callable[[EngineStats], None]] = []
        self.latencies: LatencyWindow | None = None  # while stats are watched

    def start(self) -> None:
        """Starts the core (which loads the model); call from the event loop."""
        self._loop = asyncio.get_running_loop()
        if isinstance(self._loader, EngineArgs):
            self._start_process(self._loader)
        else:
            self._threads = [threading.Thread(target=run_core, name="nanoserve-engine", daemon=True,
                                              args=(self._loader, self._receive, self._post))]
            self._threads[0].start()

    async def stop(self) -> None:
        """Stops the core: every request still in it is aborted and its stream failed. Idempotent:
        a second call (the server's lifespan after its graceful shutdown did) waits for the first."""
        self._stopping = True
        if self._loop is None:
            return
        if self._stopped is None:
            self._commands.put(None)
            timeout = PROCESS_STOP_TIMEOUT_S
            if self.state is EngineState.LOADING and self._process is not None and self._process.pid is not None:
                log.info("stopping the engine while it loads the model")
                self._load_cancelled = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._process.pid, LOAD_CANCEL_SIGNAL)
                timeout = LOAD_CANCEL_GRACE_S
            self._stopped = asyncio.ensure_future(asyncio.to_thread(self._join, timeout))
        await asyncio.shield(self._stopped)

    def unavailable_reason(self) -> str:
        return {
            EngineState.LOADING: "the model is still loading",
            EngineState.DEAD: f"the engine has stopped after an error: {self.error}"
                              + ("; it is being restarted" if self._restart_pending else ""),
            EngineState.STOPPED: "the server is shutting down",
        }.get(self.state, "")

    def add(self, prompts: list[list[int]], params: SamplingParams, *, priority: int = 0,
            kind: str = "cmpl") -> OutputStream:
        """Hands each prompt to the engine as one request with `params`. The caller has validated
        them (EngineLimits.validate). Raises EngineUnavailableError or QueueFullError."""
        self.admit(len(prompts) * params.n)
        api_id = f"{kind}-{uuid.uuid4().hex}"
        ids = [api_id] if len(prompts) == 1 else [f"{api_id}-{i}" for i in range(len(prompts))]
        stream = OutputStream(self, api_id, ids)
        for rid, prompt in zip(ids, prompts, strict=True):
            self._streams[rid] = stream
            self._commands.put(AddRequest(rid, prompt, dataclasses.replace(params), priority))
            self._handed_off.append(params.n)
        self._handed_off_seqs += len(prompts) * params.n
        return stream

    def admit(self, count: int) -> None:
        """Whether `count` more sequences (a request's prompts times its n) could be queued now
        (EngineUnavailableError or QueueFullError if not): front ends ask before they render or
        tokenize anything, and `add` asks again."""
        if self.state is not EngineState.RUNNING:
            raise EngineUnavailableError(self.unavailable_reason())
        queued = self._handed_off_seqs + self._waiting
        if queued + count > self.max_queued_requests:
            raise QueueFullError(f"{queued} sequences are waiting and this request adds {count} "
                                 f"(max_queued_requests={self.max_queued_requests} sequences)")

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._streams.pop(rid, None) is not None:
                self._commands.put(AbortRequest(rid))

    def watch_stats(self, sink: Callable[[EngineStats], None]) -> None:
        """Calls `sink` (on the event loop) with every `EngineStats` record from now until
        `unwatch_stats(sink)`; the first sink starts the records, the last one stops them."""
        self._stats_sinks.append(sink)
        if len(self._stats_sinks) == 1:
            self.latencies = LatencyWindow()
            self._commands.put(WatchStats(True))

    def unwatch_stats(self, sink: Callable[[EngineStats], None]) -> None:
        self._stats_sinks.remove(sink)
        if not self._stats_sinks:
            self.latencies = None
            self._commands.put(WatchStats(False))

    # ---- messages from the core (on the event loop) -----------------------------------------

    def _on_message(self, message: Message) -> None:
        if isinstance(message, Update):
            self._on_update(message)
        elif isinstance(message, Ready):
            self.info = message.info
            self._set_snapshot(message.snapshot)
            self.state = EngineState.RUNNING
            if self._on_ready is not None:
                self._on_ready(message.info)
        else:
            self._on_exit(message)

    def _on_update(self, update: Update) -> None:
        for _ in range(update.applied_adds):
            self._handed_off_seqs -= self._handed_off.popleft()
        self._waiting = update.snapshot.num_waiting_seqs
        self._set_snapshot(update.snapshot)
        for rid in update.scheduled:
            if (stream := self._streams.get(rid)) is not None:
                stream._on_scheduled(rid, update.started)
        for rid, reason in update.failed.items():
            if (stream := self._streams.pop(rid, None)) is not None:
                stream._fail(EngineError(reason))
        outputs: dict[OutputStream, list[SequenceDelta]] = {}
        for d in update.deltas:
            if (stream := self._streams.get(d.request_id)) is not None:
                outputs.setdefault(stream, []).append(d)
        for stream, deltas in outputs.items():
            stream._push(deltas)
        for rid in update.finished:
            if (stream := self._streams.pop(rid, None)) is not None:
                stream._finish(rid)
        if update.stats is not None:
            for sink in list(self._stats_sinks):
                sink(update.stats)

    def _on_exit(self, exited: Exited) -> None:
        self.state, self.error = exited.state, exited.error
        if self._load_cancelled:  # a load the stop cut short (the core killed, if it had to be)
            self.state, self.error = EngineState.STOPPED, None
        reason = EngineUnavailableError(self.unavailable_reason())
        streams, self._streams = set(self._streams.values()), {}
        for stream in streams:
            if exited.state is EngineState.STOPPED:
                log.warning("%s: cut by the shutdown", stream.id)
            stream._fail(reason)
        if exited.state is not EngineState.DEAD or self._stopping:
            return
        if self.info is not None and isinstance(self._loader, EngineArgs) and self._may_restart():
            delay = min(RESTART_BACKOFF_S * 2 ** (len(self._restarts) - 1), MAX_RESTART_BACKOFF_S)
            log.error("the engine core died (%s); restarting it in %.0f s (restart %d of %d within %.0f s)",
                      exited.error, delay, len(self._restarts), self.max_restarts, RESTART_WINDOW_S)
            self._restart_pending = True
            assert self._loop is not None
            self._loop.call_later(delay, self._restart, self._loader)
        else:
            if self.info is not None:
                log.error("the engine core died (%s) and is not restarted again", exited.error)
            if self._on_fatal is not None:
                self._on_fatal()

    def _may_restart(self) -> bool:
        """Records a restart, if one more is allowed within the window."""
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return False
        self._restarts.append(now)
        return True

    def _restart(self, args: EngineArgs) -> None:
        """Starts a new core process in place of the dead one (on the event loop)."""
        self._restart_pending = False
        if self._stopping:
            return
        old, self._commands = self._commands, queue.SimpleQueue()
        old.put(None)  # ends the dead core's writer thread
        self._handed_off.clear()
        self._handed_off_seqs = self._waiting = 0
        self.state, self.num_restarts = EngineState.LOADING, self.num_restarts + 1
        if self.metrics is not None:
            self.metrics.engine_restarts.inc()
        if self._stats_sinks:
            self._commands.put(WatchStats(True))
        self._start_process(args)

    def _set_snapshot(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        if self.metrics is not None:
            self.metrics.update_engine(snapshot)

    # ---- the core's side of the queue and the transport ---------------------------------------

    def _receive(self, timeout: float | None) -> list[Command]:
        """The commands queued so far (on the core thread), waiting up to `timeout` seconds
        (None: however long) for the first."""
        commands: list[Command] = []
        if timeout != 0.0:
            with contextlib.suppress(queue.Empty):
                commands.append(self._commands.get(timeout=timeout))
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _post(self, message: Message) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_message, message)
        except RuntimeError:
            log.debug("the event loop is closed; dropping an engine message")

    def _start_process(self, args: EngineArgs) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork: this process has threads
        commands_r, commands_w = ctx.Pipe(duplex=False)
        outputs_r, outputs_w = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_core_process, name="nanoserve-engine-core", daemon=True,
                                    args=(args, commands_r, outputs_w, logging.getLogger().getEffectiveLevel()))
        resource_tracker.ensure_running()  # started now: its own start would unblock the signals blocked here
        with _blocked_in_children(signal.SIGINT, signal.SIGTERM):
            self._process.start()
        commands_r.close()  # the core's ends: only the core may hold them, so that either side's
        outputs_w.close()  # exit is the other's end of file
        self._threads = [
            threading.Thread(target=self._forward, args=(commands_w,), name="nanoserve-core-writer", daemon=True),
            threading.Thread(target=self._read, args=(outputs_r, self._process), name="nanoserve-core-reader",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _forward(self, pipe: Connection) -> None:
        """Writes the queued commands to the core's pipe until the stop command (or a dead core)."""
        with pipe:
            while True:
                command = self._commands.get()
                try:
                    pipe.send(command)
                except OSError:
                    return
                if command is None:
                    return

    def _read(self, pipe: Connection, process: BaseProcess) -> None:
        """Posts the core's messages until its `Exited`; a core that dies without one is dead."""
        with pipe:
            while True:
                try:
                    message = pipe.recv()
                except (EOFError, OSError):
                    break
                self._post(message)
                if isinstance(message, Exited):
                    return
        process.join(timeout=PROCESS_STOP_TIMEOUT_S)
        self._post(Exited(EngineState.DEAD, f"the engine process exited with code {process.exitcode}"))

    def _join(self, timeout: float) -> None:
        """Waits for the core to exit, `timeout` seconds for a core process, then kills it (SIGKILL:
        it ignores SIGTERM, see `run_core_process`)."""
        if self._process is not None:
            self._process.join(timeout=timeout)
            if self._process.is_alive():
                log.warning("the engine process did not stop in %.0f s; killing it", timeout)
                self._process.kill()
                self._process.join()
        for thread in self._threads:
            thread.join()


@contextlib.contextmanager
def _blocked_in_children(*signals: signal.Signals) -> Iterator[None]:
    """Blocks `signals` on this thread while a child process starts from it, so that the child
    starts with them blocked (a signal mask is inherited through fork and exec): a Ctrl-C or
    SIGTERM to the process group while the engine-core process imports is the front end's alone to
    act on (`run_core_process` discards and unblocks them; multiprocessing starts its resource
    tracker the same way). This process loses none: another of its threads takes them meanwhile,
    or this one once they are unblocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass(slots=True)
class _Progress:
    arrival: float
    last: float | None = None  # when the previous output went to the consumer
    reason: str | None = None  # finish reason of sample 0


class OutputStream:
    """The outputs of one API request: one engine request per prompt, each with n sequences.

    Lives on the event loop. Iterating yields lists of deltas of this request's sequences, each
    sequence's deltas since the previous list merged into one (`coalesce`): per engine step, or
    every `stream_interval` steps (always at a request's first output and when a sequence
    finishes), and in one list whatever piled up while the consumer was busy: one chunk to write,
    not one per step. It ends once the engine reported every request finished, and raises
    EngineError if the engine failed one. `close()` aborts whatever has not finished and is
    idempotent: handlers call it whenever they stop listening (client gone, error, shutdown).
    """

    def __init__(self, owner: AsyncEngine, api_id: str, request_ids: list[str]) -> None:
        self.id = api_id
        self.request_ids = request_ids
        self._owner = owner
        self._metrics = owner.metrics
        self._interval = owner.stream_interval
        now = time.monotonic()
        self._open = {rid: _Progress(now) for rid in request_ids}  # engine requests not finished
        self._pending: list[SequenceDelta] = []  # arrived, not yet taken by the consumer
        self._released = 0  # how many of `_pending` are due to the consumer
        self._held_steps = 0  # steps whose outputs are pending but not yet due
        self._end: BaseException | None = None  # the error that ends the stream, once `_closed`
        self._closed = False
        self._wake = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[list[SequenceDelta]]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            closed = self._closed  # once closed, everything pending is due: this takes the last of it
            due, self._pending = self._pending[: self._released], self._pending[self._released :]
            self._released = 0
            if due:
                yield due if len(due) == 1 else coalesce(due)
            if closed:
                if self._end is not None:
                    raise self._end
                return

    def close(self) -> None:
        self._stop("abort", None)

    def _fail(self, error: BaseException) -> None:
        self._stop("error", error)

    def _stop(self, reason: str, error: BaseException | None) -> None:
        """Ends the stream early: what arrived is still yielded, then `error` raised (if any)."""
        if self._closed:
            return
        if self._metrics is not None:
            for _ in self._open:
                self._metrics.record_finished(reason, None)
        self._owner.abort(list(self._open))
        self._open.clear()
        self._end = error
        self._close()

    def _close(self) -> None:
        self._closed, self._released = True, len(self._pending)
        self._wake.set()

    def _on_scheduled(self, request_id: str, started: float) -> None:
        progress = self._open.get(request_id)
        if progress is not None and self._metrics is not None:
            self._metrics.queue_time.observe(max(started - progress.arrival, 0.0))

    def _push(self, deltas: list[SequenceDelta]) -> None:
        """Takes one step's deltas of this stream's open requests; wakes the consumer when due."""
        self._pending += deltas
        self._held_steps += 1
        due = self._held_steps >= self._interval
        for d in deltas:
            if d.finished:
                due = True
                if d.index == 0:
                    self._open[d.request_id].reason = d.finish_reason
            elif self._open[d.request_id].last is None:
                due = True  # a request's first output
        if due:
            self._release()

    def _release(self) -> None:
        """Makes everything pending due to the consumer and wakes it."""
        now = time.monotonic()
        recent = self._owner.latencies
        for rid in dict.fromkeys(d.request_id for d in self._pending[self._released :]):
            p = self._open[rid]
            first = p.last is None
            latency = now - (p.arrival if p.last is None else p.last)
            if self._metrics is not None:
                (self._metrics.ttft if first else self._metrics.itl).observe(latency)
            if recent is not None:
                (recent.ttft if first else recent.itl).append((now, latency))
            p.last = now
        self._released, self._held_steps = len(self._pending), 0
        self._wake.set()

    def _finish(self, request_id: str) -> None:
        """The engine finished the request; its last deltas were pushed before this call."""
        p = self._open.pop(request_id)
        if self._metrics is not None:
            self._metrics.record_finished(p.reason or "stop", time.monotonic() - p.arrival)
        if not self._open:
            self._close()
