"""The engine loop on its own thread, and the asyncio side that request handlers use.

Threads: only the engine thread touches the `LLMEngine` (add_request, step, abort, kv_stats).
Handlers on the event loop hand it commands through a thread-safe queue, which it drains between
steps and blocks on when idle (no busy-spin); outputs come back once per step through
`loop.call_soon_threadsafe` into one asyncio queue per API request (`OutputStream`). Aborts
therefore happen between steps, and an aborted request's blocks are free after the next drain.

Failures: an exception in `add_request` fails that request only; an exception in `step` fails
every request in flight (the batch is shared), after which the engine must hold no request and no
block, or it is declared dead (state DEAD, /health 503, new requests refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from nanoserve.engine.llm_engine import KVStats, LLMEngine, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import SpecStats
from nanoserve.server.deltas import coalesce
from nanoserve.server.metrics import Metrics

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    RUNNING = "running"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineError(RuntimeError):
    """The engine failed a request."""


class EngineUnavailableError(EngineError):
    """The engine is loading, dead or stopped and takes no request."""


class QueueFullError(RuntimeError):
    """`max_queued_requests` requests are already waiting."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state after one iteration of the engine loop. Requests, not sequences: a
    request is waiting while none of its sequences runs or has finished."""

    num_running: int
    num_waiting: int
    kv: KVStats
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats


@dataclass(slots=True)
class _Add:
    stream: OutputStream
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(slots=True)
class _Abort:
    request_id: str


_Command = _Add | _Abort | None  # None stops the loop


@dataclass(slots=True)
class _Live:
    """Engine-thread record of a request in the engine."""

    stream: OutputStream
    remaining: int  # sequences not finished
    scheduled: bool = False
    sent: bool = False  # whether any output went to the stream yet
    held: list[SequenceDelta] = dataclasses.field(default_factory=list)  # not yet sent (stream_interval)
    held_steps: int = 0  # steps whose outputs are in `held`


class AsyncEngine:
    """Owns the engine thread. States: LOADING -> RUNNING -> STOPPED (stop) or DEAD (a broken
    engine); LOADING -> DEAD when the loader raises. Requests are accepted only while RUNNING and
    while fewer than `max_queued_requests` requests wait, counting those handed off but not yet
    seen by the engine, so the waiting queue is bounded at every moment."""

    def __init__(self, loader: Callable[[], LLMEngine], *, max_queued_requests: int = 1024,
                 metrics: Metrics | None = None, stream_interval: int = 1) -> None:
        """`stream_interval`: a request's outputs go to its stream every this many steps (merged
        per sequence), and always at its first output and when a sequence finishes; more than 1
        trades inter-token latency for fewer, larger chunks (less event-loop and SSE work)."""
        if max_queued_requests < 1:
            raise ValueError("max_queued_requests must be at least 1")
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        self.max_queued_requests = max_queued_requests
        self.stream_interval = stream_interval
        self.metrics = metrics
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self.engine: LLMEngine | None = None  # set once loaded; read-only outside the engine thread
        self.snapshot: EngineSnapshot | None = None
        self._loader = loader
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards state changes, _handed_off and _waiting
        self._handed_off = 0
        self._waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: dict[str, _Live] = {}  # engine thread only

    # ---- event-loop side -------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread (which loads the model); call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Aborts every request still in the engine, fails their streams and joins the thread."""
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)

    def unavailable_reason(self) -> str:
        return {
            EngineState.LOADING: "the model is still loading",
            EngineState.DEAD: f"the engine has stopped after an error: {self.error}",
            EngineState.STOPPED: "the server is shutting down",
        }.get(self.state, "")

    def add(self, prompts: list[list[int]], params: SamplingParams, *, priority: int = 0,
            kind: str = "cmpl") -> OutputStream:
        """Hands each prompt to the engine as one request with `params`. The caller has validated
        them (engine.validate). Raises EngineUnavailableError or QueueFullError."""
        api_id = f"{kind}-{uuid.uuid4().hex}"
        ids = [api_id] if len(prompts) == 1 else [f"{api_id}-{i}" for i in range(len(prompts))]
        with self._lock:
            if self.state is not EngineState.RUNNING:
                raise EngineUnavailableError(self.unavailable_reason())
            if self._handed_off + self._waiting + len(prompts) > self.max_queued_requests:
                raise QueueFullError(f"{self._handed_off + self._waiting} requests are waiting "
                                     f"(max_queued_requests={self.max_queued_requests})")
            stream = OutputStream(self, api_id, ids, params.n)
            for rid, prompt in zip(ids, prompts, strict=True):
                self._commands.put(_Add(stream, rid, prompt, dataclasses.replace(params), priority))
            self._handed_off += len(prompts)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._commands.put(_Abort(rid))

    def _dispatch(self, outputs: dict[OutputStream, list[SequenceDelta]],
                  scheduled: list[tuple[OutputStream, str]], started: float) -> None:
        for stream, rid in scheduled:
            stream._on_scheduled(rid, started)
        for stream, deltas in outputs.items():
            stream._push(deltas)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._loader()
        except BaseException as e:
            log.exception("loading the model failed")
            self._exit(None, EngineState.DEAD, e)
            return
        self.engine = engine
        self._publish(engine)
        with self._lock:
            self.state = EngineState.RUNNING
        try:
            self._serve(engine)
        except BaseException as e:
            log.exception("the engine loop failed; the engine is dead")
            self._exit(engine, EngineState.DEAD, e)
        else:
            self._exit(engine, EngineState.STOPPED, None)

    def _serve(self, engine: LLMEngine) -> None:
        while self._apply_commands(engine, block=not engine.has_unfinished()):
            if not engine.has_unfinished():
                continue
            started = time.monotonic()
            try:
                deltas = engine.step()
            except Exception as e:
                log.exception("an engine step failed; failing the requests in flight")
                self._fail_live(engine, EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                if engine.has_unfinished() or engine.kv_stats().blocks_used:
                    raise RuntimeError("the engine still holds requests or blocks after a failed step") from e
                self._publish(engine)
                continue
            self._deliver(engine, deltas, started)

    def _apply_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Applies every queued command; False once a stop was among them."""
        commands: list[_Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        adds = 0
        for cmd in commands:
            if isinstance(cmd, _Add):
                adds += 1
                self._add(engine, cmd)
            elif isinstance(cmd, _Abort):
                self._live.pop(cmd.request_id, None)
                engine.abort(cmd.request_id)
        self._publish(engine, applied_adds=adds)
        return None not in commands

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        try:
            engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.priority)
        except Exception as e:
            log.exception("adding request %s failed", cmd.request_id)
            self._post(cmd.stream._fail, EngineError(f"the engine refused the request: {e}"))
            return
        self._live[cmd.request_id] = _Live(cmd.stream, cmd.params.n)

    def _deliver(self, engine: LLMEngine, deltas: list[SequenceDelta], started: float) -> None:
        waiting = self._publish(engine)
        outputs: dict[OutputStream, list[SequenceDelta]] = {}
        scheduled: list[tuple[OutputStream, str]] = []
        for rid, live in self._live.items():
            if not live.scheduled and rid not in waiting:
                live.scheduled = True
                scheduled.append((live.stream, rid))
        stepped: dict[str, _Live] = {}
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is None:
                continue
            live.held.append(d)
            stepped[d.request_id] = live
            if d.finished:
                live.remaining -= 1
                if live.remaining == 0:
                    del self._live[d.request_id]
        for live in stepped.values():
            live.held_steps += 1
            due = not live.sent or live.held_steps >= self.stream_interval
            if due or any(d.finished for d in live.held):
                held = live.held if len(live.held) == 1 else coalesce(live.held)
                outputs.setdefault(live.stream, []).extend(held)
                live.held, live.held_steps, live.sent = [], 0, True
        if outputs or scheduled:
            self._post(self._dispatch, outputs, scheduled, started)

    def _publish(self, engine: LLMEngine, applied_adds: int = 0) -> set[str]:
        """Publishes the snapshot (and the waiting count the admission check reads); returns
        the ids of the waiting requests."""
        sched = engine.scheduler
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting} - running
        snap = EngineSnapshot(len(running), len(waiting), engine.kv_stats(), engine.num_prompt_tokens,
                              engine.num_generated_tokens, dataclasses.replace(engine.spec_stats))
        with self._lock:
            self._handed_off -= applied_adds
            self._waiting = len(waiting)
        self.snapshot = snap
        if self.metrics is not None:
            self.metrics.update_engine(snap)
        return waiting

    def _fail_live(self, engine: LLMEngine, error: EngineError) -> None:
        """Fails the stream of every request in the engine, then aborts the requests."""
        live, self._live = self._live, {}
        for entry in live.values():
            self._post(entry.stream._fail, error)
        for rid in live:
            engine.abort(rid)

    def _exit(self, engine: LLMEngine | None, state: EngineState, error: BaseException | None) -> None:
        with self._lock:
            self.state, self.error = state, error
        reason = EngineUnavailableError(self.unavailable_reason())
        while True:  # no add can be queued any more: add() checks the state under the lock
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._post(cmd.stream._fail, reason)
        if engine is None:
            return
        try:
            self._fail_live(engine, reason)
            self._publish(engine)
        except Exception:
            log.exception("cleaning up the engine failed")

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            log.debug("the event loop is closed; dropping an engine output")


@dataclass(slots=True)
class _Progress:
    arrival: float
    remaining: int  # sequences not finished
    last: float | None = None  # when the previous output arrived
    reason: str | None = None  # finish reason of sample 0


class OutputStream:
    """The outputs of one API request: one engine request per prompt, each with n sequences.

    Lives on the event loop. Iterating yields, per engine step, the deltas of this request's
    sequences and ends once every sequence has finished; it raises EngineError if the engine
    failed the request. A consumer that fell behind by several steps gets them in one list, each
    sequence's deltas merged into one (`coalesce`): one chunk to write, not one per step.
    `close()` aborts whatever has not finished and is idempotent: handlers call it whenever they
    stop listening (client gone, error, shutdown).
    """

    def __init__(self, owner: AsyncEngine, api_id: str, request_ids: list[str], n: int) -> None:
        self.id = api_id
        self.request_ids = request_ids
        self._owner = owner
        self._metrics = owner.metrics
        now = time.monotonic()
        self._open = {rid: _Progress(now, n) for rid in request_ids}  # engine requests not finished
        self._queue: asyncio.Queue[list[SequenceDelta] | BaseException | None] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[list[SequenceDelta]]:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():  # a consumer that fell behind takes all that is queued
                items.append(self._queue.get_nowait())
            batches = [item for item in items if isinstance(item, list)]
            if len(batches) == 1:
                yield batches[0]
            elif batches:
                yield coalesce([d for batch in batches for d in batch])
            end = items[-1]  # None or an error only ever comes last
            if isinstance(end, BaseException):
                raise end
            if end is None:
                return

    def close(self) -> None:
        self._end("abort", None)

    def _fail(self, error: BaseException) -> None:
        self._end("error", error)

    def _end(self, reason: str, error: BaseException | None) -> None:
        if not self._open:
            return
        if self._metrics is not None:
            for _ in self._open:
                self._metrics.record_finished(reason, None)
        self._owner.abort(list(self._open))
        self._open.clear()
        self._queue.put_nowait(error)

    def _on_scheduled(self, request_id: str, started: float) -> None:
        progress = self._open.get(request_id)
        if progress is not None and self._metrics is not None:
            self._metrics.queue_time.observe(max(started - progress.arrival, 0.0))

    def _push(self, deltas: list[SequenceDelta]) -> None:
        deltas = [d for d in deltas if d.request_id in self._open]
        if not deltas:
            return
        now = time.monotonic()
        for rid in dict.fromkeys(d.request_id for d in deltas):
            p = self._open[rid]
            if self._metrics is not None:
                if p.last is None:
                    self._metrics.ttft.observe(now - p.arrival)
                else:
                    self._metrics.itl.observe(now - p.last)
            p.last = now
        for d in deltas:
            if not d.finished:
                continue
            p = self._open[d.request_id]
            p.reason = p.reason or (d.finish_reason if d.index == 0 else None)
            p.remaining -= 1
            if p.remaining == 0:
                del self._open[d.request_id]
                if self._metrics is not None:
                    self._metrics.record_finished(p.reason or d.finish_reason or "stop", now - p.arrival)
        self._queue.put_nowait(deltas)
        if not self._open:
            self._queue.put_nowait(None)
