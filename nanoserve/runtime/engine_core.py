"""The engine core: the loop that owns an `LLMEngine`, and the messages it exchanges with the
front end (`nanoserve.runtime.async_engine`). It runs on a thread of the server process, or in a
process of its own, so that the engine's Python and the HTTP side's Python do not take turns on
one interpreter lock (vLLM V1's split of its API server from its EngineCore).

Protocol. The front end sends `Command`s: `AddRequest`, `AbortRequest`, `WatchStats`, and None
to stop. The core sends `Ready` once the model is loaded, then one `Update` per iteration of its
loop, and `Exited` last (also when loading fails). An iteration applies every command queued since
the last one, runs one engine step if any request is unfinished, and reports both in one `Update`.
The core waits on the command source only while it holds no request, so it never spins idle and
never waits for a command while it has work; while stats are watched (`WatchStats(True)`), an
`Update` carries an `EngineStats` record at most every `STATS_INTERVAL_S`, and an idle core
wakes up to send one that often. Unwatched, the engine records nothing for them.

Failures. An exception in `add_request`, or a constraint the engine's compile threads could not
compile (`StepOutput.failed`), fails that request only; an exception in `step` fails
every request in flight (the batch is shared), after which the engine must hold no request and no
block, or the loop raises and the core exits dead; a `RunnerFailure` (a lost tensor-parallel rank)
makes it exit dead at once. Every exit closes the engine.

Stopping while loading. The core reads no command before its model is loaded, so a stop sent then
would wait for the whole load. A core process therefore takes `LOAD_CANCEL_SIGNAL` while (and only
while) it loads: the signal raises `LoadCancelled` in its main thread, which unwinds the load
(temporary files removed, a compiler it started killed, as on any error), and the core exits
`STOPPED`. Once loaded, the signal is ignored and the stop command is the way to stop it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType

import torch

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.model_runner import RunnerFailure
from nanoserve.engine.outputs import EngineLimits, EngineSnapshot, EngineStats, SequenceDelta, StepOutput
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.log import configure_logging
from nanoserve.model.quant.weight_formats import LinearWeight
from nanoserve.runtime.builder import build_engine
from nanoserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.2  # the shortest time between two EngineStats records
LOAD_CANCEL_SIGNAL = signal.SIGUSR1  # the front end's "stop loading" to a core process (see the module's docstring)


class LoadCancelled(BaseException):
    """The front end stopped the core while it was loading the model. A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` of the loading code takes it for a failure."""


class EngineState(enum.Enum):
    LOADING = "loading"
    RUNNING = "running"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class EngineSummary:
    """What the engine runs, for the server's "ready" line: the model's dtype, the storage
    formats of its matrices ("dense", or GGUF block formats such as "q4_k"), the compute threads of
    the engine's process."""

    dtype: str
    weight_formats: tuple[str, ...]
    threads: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSummary:
        model = engine.model
        formats = {m.format for m in model.modules() if isinstance(m, LinearWeight) and m.format != "stacked"} \
            if isinstance(model, torch.nn.Module) else set()
        return cls(str(model.dtype).removeprefix("torch."), tuple(sorted(formats)), torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a front end needs of a loaded engine to take requests: its tokenizer (None: token
    ids only), the limits a request is validated against, the sampling defaults it fills unset
    fields with (the model's generation config), and what it runs (`summary`)."""

    tokenizer: Tokenizer | None
    limits: EngineLimits
    sampling_defaults: dict[str, float | int] = dataclasses.field(default_factory=dict)
    summary: EngineSummary | None = None


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class WatchStats:
    """Starts (on) or stops sending `EngineStats` records (the front end counts its watchers)."""

    on: bool


Command = AddRequest | AbortRequest | WatchStats | None  # None stops the core


@dataclass(frozen=True, slots=True)
class Ready:
    info: EngineInfo
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class Update:
    """One iteration. `applied_adds`: AddRequests taken off the command source in it (accepted
    or refused). `deltas`: the outputs of this iteration's step, in step order. `finished`:
    requests whose last output is in `deltas` (an aborted request is never reported).
    `scheduled`: requests that ran for the first time in this iteration's step, which began at
    `started` (time.monotonic, one clock for every process of the machine). `failed`: request id
    -> why the engine refused or failed it; such a request is gone from the engine. `stats`: a
    record of the engine's insides, while watched and due (see the module's docstring)."""

    snapshot: EngineSnapshot
    applied_adds: int = 0
    deltas: list[SequenceDelta] = dataclasses.field(default_factory=list)
    finished: list[str] = dataclasses.field(default_factory=list)
    scheduled: list[str] = dataclasses.field(default_factory=list)
    started: float = 0.0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    stats: EngineStats | None = None


@dataclass(frozen=True, slots=True)
class Exited:
    """The last message: `state` is STOPPED (asked to stop) or DEAD (`error` says why)."""

    state: EngineState
    error: str | None = None


Message = Ready | Update | Exited
Receive = Callable[[float | None], list[Command]]  # waits up to this long (None: however long) for one command
Send = Callable[[Message], None]


class EngineCore:
    """Drives one engine. It keeps one record per request in the engine: whether it has been
    seen running yet (for `Update.scheduled`); the engine says when a request ends. While stats
    are watched, `_next_stats` is when the next record is due (time.monotonic)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._scheduled: dict[str, bool] = {}  # request id -> seen running; every request in the engine
        self._watched = False
        self._next_stats = 0.0

    def run(self, receive: Receive, send: Send) -> None:
        """Serves until a stop command. Raises if the engine is left broken by a failed step."""
        engine = self.engine
        while True:
            commands = receive(0.0 if engine.has_unfinished() else self._idle_wait())
            failed: dict[str, str] = {}
            adds = self._apply(commands, failed)
            if None in commands:
                return
            out = StepOutput([])
            started = time.monotonic()
            if engine.has_unfinished():
                try:
                    out = engine.step()
                except RunnerFailure:
                    raise  # no step can run again: the core exits dead, failing every request
                except Exception as e:
                    log.exception("an engine step failed; failing the requests in flight")
                    self._fail_live(f"the engine failed: {type(e).__name__}: {e}", failed)
                    if engine.has_unfinished() or engine.kv_stats().blocks_used:
                        raise RuntimeError("the engine still holds requests or blocks after a failed step") from e
            for rid in out.finished:
                del self._scheduled[rid]
            for rid, reason in out.failed.items():
                del self._scheduled[rid]
                failed[rid] = f"the engine refused the request: {reason}"
            scheduled = self._newly_scheduled()
            send(Update(snapshot=engine.snapshot(), applied_adds=adds, deltas=out.deltas, finished=out.finished,
                        scheduled=scheduled, started=started, failed=failed, stats=self._due_stats()))

    def abort_all(self) -> None:
        """Aborts every request in the engine and forgets it (at exit, and after a failed step)."""
        for rid in self._scheduled:
            self.engine.abort(rid)
        self._scheduled.clear()

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
                    self._scheduled[cmd.request_id] = False
            elif isinstance(cmd, AbortRequest):
                self._scheduled.pop(cmd.request_id, None)
                self.engine.abort(cmd.request_id)
            elif isinstance(cmd, WatchStats):
                self._watched = cmd.on
                self.engine.live_stats.record_steps(cmd.on)
                self._next_stats = 0.0  # a new watcher gets a record at once
        return adds

    def _idle_wait(self) -> float | None:
        """How long an idle core may wait for a command: until the next record is due, if watched."""
        return max(self._next_stats - time.monotonic(), 0.0) if self._watched else None

    def _due_stats(self) -> EngineStats | None:
        if not self._watched:
            return None
        now = time.monotonic()
        if now < self._next_stats:
            return None
        self._next_stats = now + STATS_INTERVAL_S
        return self.engine.live_stats.record()

    def _newly_scheduled(self) -> list[str]:
        scheduled = []
        for rid, seen in self._scheduled.items():
            if not seen and self.engine.started(rid):
                self._scheduled[rid] = True
                scheduled.append(rid)
        return scheduled

    def _fail_live(self, message: str, failed: dict[str, str]) -> None:
        """Fails every request in the engine with `message`, and aborts them."""
        for rid in self._scheduled:
            failed[rid] = message
        self.abort_all()


def run_core(loader: Callable[[], LLMEngine], receive: Receive, send: Send) -> None:
    """Loads the engine and serves it until a stop command or a broken engine; every outcome ends
    with an `Exited` message, and no request is left in the engine."""
    try:
        engine = loader()
    except LoadCancelled:
        log.debug("the load was cancelled", exc_info=True)
        send(Exited(EngineState.STOPPED))
        return
    except BaseException as e:  # the front end reports it in one line; the traceback at DEBUG
        log.debug("loading the model failed", exc_info=True)
        send(Exited(EngineState.DEAD, str(e)))
        return
    core = EngineCore(engine)
    info = EngineInfo(engine.tokenizer, engine.limits, engine.sampling_defaults, EngineSummary.of(engine))
    send(Ready(info, engine.snapshot()))
    try:
        core.run(receive, send)
    except BaseException as e:
        log.exception("the engine loop failed; the engine is dead")
        exited = Exited(EngineState.DEAD, str(e))
    else:
        exited = Exited(EngineState.STOPPED)
    try:
        core.abort_all()
        engine.close()
    except Exception:
        log.exception("cleaning up the engine failed")
    send(exited)


def run_core_process(args: EngineArgs, commands: Connection, outputs: Connection, log_level: int) -> None:
    """The engine-core process: builds the engine from `args` and serves it over two pipes. A
    closed command pipe (the front end is gone) stops it like a stop command. SIGINT and SIGTERM
    are ignored: a terminal's Ctrl-C or a service manager's SIGTERM reaches the whole process
    group, and the front end, which lets requests in flight finish first, stops the core through
    the pipe; while the model loads, `LOAD_CANCEL_SIGNAL` stops the load."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked until now: AsyncEngine
    configure_logging(log_level)

    def load() -> LLMEngine:  # before it, the signal's default action ends the process: nothing to unwind yet
        signal.signal(LOAD_CANCEL_SIGNAL, _cancel_load)
        try:
            return build_engine(args)
        finally:
            signal.signal(LOAD_CANCEL_SIGNAL, signal.SIG_IGN)

    def receive(timeout: float | None) -> list[Command]:
        received: list[Command] = []
        try:
            if timeout != 0.0 and commands.poll(timeout):
                received.append(commands.recv())
            while commands.poll():
                received.append(commands.recv())
        except EOFError:
            received.append(None)
        return received

    def send(message: Message) -> None:
        with contextlib.suppress(OSError):  # the front end is gone; the command pipe's end stops the loop
            outputs.send(message)

    run_core(load, receive, send)


def _cancel_load(sig: int, frame: FrameType | None) -> None:
    raise LoadCancelled("the server stopped while the model was loading")
