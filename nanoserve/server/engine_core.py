"""The engine core: the loop that owns an `LLMEngine`, and the messages it exchanges with the
front end (`nanoserve.server.async_engine`). It runs on a thread of the server process, or in a
process of its own, so that the engine's Python and the HTTP side's Python do not take turns on
one interpreter lock (vLLM V1's split of its API server from its EngineCore).

Protocol. The front end sends `Command`s: `AddRequest`, `AbortRequest`, and None to stop. The
core sends `Ready` once the model is loaded, then one `Update` per iteration of its loop, and
`Exited` last (also when loading fails). An iteration applies every command queued since the
last one, runs one engine step if any request is unfinished, and reports both in one `Update`.
The core blocks on the command source only while it holds no request, so it never spins idle and
never waits for a command while it has work.

Failures. An exception in `add_request` fails that request only; an exception in `step` fails
every request in flight (the batch is shared), after which the engine must hold no request and no
block, or the loop raises and the core exits dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm import build_engine
from nanoserve.engine.llm_engine import EngineLimits, KVStats, LLMEngine, SequenceDelta
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import SpecStats
from nanoserve.log import configure_logging
from nanoserve.server.deltas import coalesce
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    RUNNING = "running"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end needs of a loaded engine to take requests: its tokenizer (None: token
    ids only) and the limits a request is validated against."""

    tokenizer: Tokenizer | None
    limits: EngineLimits


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state after one iteration of the core loop. Requests, not sequences: a
    request is waiting while none of its sequences runs or has finished."""

    num_running: int
    num_waiting: int
    kv: KVStats
    prompt_tokens: int
    generation_tokens: int
    spec: SpecStats


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(slots=True)
class AbortRequest:
    request_id: str


Command = AddRequest | AbortRequest | None  # None stops the core


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class Update:
    """One iteration. `applied_adds`: AddRequests taken off the command source in it (accepted
    or refused). `deltas`: the outputs due to the streams, in step order (see `stream_interval`).
    `scheduled`: requests that ran for the first time in this iteration's step, which began at
    `started` (time.monotonic, one clock for every process of the machine). `failed`: request id
    -> why the engine refused or failed it; such a request is gone from the engine."""

    snapshot: EngineSnapshot
    applied_adds: int = 0
    deltas: list[SequenceDelta] = dataclasses.field(default_factory=list)
    scheduled: list[str] = dataclasses.field(default_factory=list)
    started: float = 0.0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Exited:
    """The last message: `state` is STOPPED (asked to stop) or DEAD (`error` says why)."""

    state: EngineState
    error: str | None = None


Message = Ready | Update | Exited
Receive = Callable[[bool], list[Command]]  # block: wait for at least one command
Send = Callable[[Message], None]


@dataclass(slots=True)
class _Live:
    """The core's record of a request in the engine."""

    remaining: int  # sequences not finished
    scheduled: bool = False
    sent: bool = False  # whether any output was sent yet
    held: list[SequenceDelta] = dataclasses.field(default_factory=list)  # not yet sent (stream_interval)
    held_steps: int = 0  # steps whose outputs are in `held`


class EngineCore:
    """Drives one engine. `stream_interval`: a request's outputs are sent every this many steps
    (merged per sequence), and always at its first output and when a sequence finishes; more than
    1 trades inter-token latency for fewer, larger messages and chunks."""

    def __init__(self, engine: LLMEngine, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError("stream_interval must be at least 1")
        self.engine = engine
        self.stream_interval = stream_interval
        self._live: dict[str, _Live] = {}

    def run(self, receive: Receive, send: Send) -> None:
        """Serves until a stop command. Raises if the engine is left broken by a failed step."""
        engine = self.engine
        while True:
            commands = receive(not engine.has_unfinished())
            failed: dict[str, str] = {}
            adds = self._apply(commands, failed)
            if None in commands:
                return
            deltas: list[SequenceDelta] = []
            started = time.monotonic()
            if engine.has_unfinished():
                try:
                    deltas = engine.step()
                except Exception as e:
                    log.exception("an engine step failed; failing the requests in flight")
                    self._fail_live(f"the engine failed: {type(e).__name__}: {e}", failed)
                    if engine.has_unfinished() or engine.kv_stats().blocks_used:
                        raise RuntimeError("the engine still holds requests or blocks after a failed step") from e
            snapshot, waiting = self.snapshot()
            scheduled = self._newly_scheduled(waiting)
            send(Update(snapshot, adds, self._due(deltas), scheduled, started, failed))

    def snapshot(self) -> tuple[EngineSnapshot, set[str]]:
        """The engine's snapshot and the ids of its waiting requests."""
        engine = self.engine
        sched = engine.scheduler
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting} - running
        snap = EngineSnapshot(len(running), len(waiting), engine.kv_stats(), engine.num_prompt_tokens,
                              engine.num_generated_tokens, dataclasses.replace(engine.spec_stats))
        return snap, waiting

    def abort_all(self) -> None:
        """Aborts every request in the engine and forgets it (at exit, and after a failed step)."""
        for rid in list(self._live):
            self.engine.abort(rid)
        self._live.clear()

    def _apply(self, commands: list[Command], failed: dict[str, str]) -> int:
        """Applies the commands in order; returns how many were AddRequests."""
        adds = 0
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                adds += 1
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.priority)
                except Exception as e:
                    log.exception("adding request %s failed", cmd.request_id)
                    failed[cmd.request_id] = f"the engine refused the request: {e}"
                else:
                    self._live[cmd.request_id] = _Live(cmd.params.n)
            elif isinstance(cmd, AbortRequest):
                self._live.pop(cmd.request_id, None)
                self.engine.abort(cmd.request_id)
        return adds

    def _newly_scheduled(self, waiting: set[str]) -> list[str]:
        scheduled = []
        for rid, live in self._live.items():
            if not live.scheduled and rid not in waiting:
                live.scheduled = True
                scheduled.append(rid)
        return scheduled

    def _due(self, deltas: list[SequenceDelta]) -> list[SequenceDelta]:
        """Holds each request's deltas until its outputs are due; returns those that are."""
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
        due: list[SequenceDelta] = []
        for live in stepped.values():
            live.held_steps += 1
            if not live.sent or live.held_steps >= self.stream_interval or any(d.finished for d in live.held):
                due.extend(live.held if len(live.held) == 1 else coalesce(live.held))
                live.held, live.held_steps, live.sent = [], 0, True
        return due

    def _fail_live(self, message: str, failed: dict[str, str]) -> None:
        """Fails every request in the engine with `message`, and aborts them."""
        for rid in self._live:
            failed[rid] = message
        self.abort_all()


def run_core(loader: Callable[[], LLMEngine], stream_interval: int, receive: Receive, send: Send) -> None:
    """Loads the engine and serves it until a stop command or a broken engine; every outcome ends
    with an `Exited` message, and no request is left in the engine."""
    try:
        engine = loader()
    except BaseException as e:
        log.exception("loading the model failed")
        send(Exited(EngineState.DEAD, str(e)))
        return
    core = EngineCore(engine, stream_interval)
    send(Ready(EngineInfo(engine.tokenizer, engine.limits), core.snapshot()[0]))
    try:
        core.run(receive, send)
    except BaseException as e:
        log.exception("the engine loop failed; the engine is dead")
        exited = Exited(EngineState.DEAD, str(e))
    else:
        exited = Exited(EngineState.STOPPED)
    try:
        core.abort_all()
    except Exception:
        log.exception("cleaning up the engine failed")
    send(exited)


def run_core_process(args: EngineArgs, stream_interval: int, commands: Connection, outputs: Connection,
                     log_level: int) -> None:
    """The engine-core process: builds the engine from `args` and serves it over two pipes. A
    closed command pipe (the front end is gone) stops it like a stop command. SIGINT and SIGTERM
    are ignored: a terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process
    group, and the front end, which lets requests in flight finish first, stops the core through
    the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level)

    def receive(block: bool) -> list[Command]:
        received: list[Command] = []
        try:
            if block:
                received.append(commands.recv())
            while commands.poll():
                received.append(commands.recv())
        except EOFError:
            received.append(None)
        return received

    def send(message: Message) -> None:
        with contextlib.suppress(OSError):  # the front end is gone; the command pipe's end stops the loop
            outputs.send(message)

    run_core(functools.partial(build_engine, args), stream_interval, receive, send)
