"""`nanoserve serve`: the OpenAI-compatible HTTP server.

Startup checks what it can before it loads anything (the flags agree, the model names something
that exists and is readable, the port is free: the listening socket is bound first and handed to
uvicorn), then logs one line per stage and one "ready" line once /health answers 200. Its parser
imports nothing heavy; `run` imports the server and the engine."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib.metadata
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from
from nanoserve.model.checkpoint.sources import source_kind
from nanoserve.runtime.defaults import DEFAULT_MAX_RESTARTS
from nanoserve.server.chat.reasoning_parsers import REASONING_PARSER_NAMES, REASONING_PARSERS
from nanoserve.server.chat.tool_parsers.registry import PARSER_NAMES, TOOL_PARSERS
from nanoserve.server.defaults import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_PROMPT_WORKERS,
    DEMO_MODEL_NAME,
)
from nanoserve.server.response_store import DEFAULT_RESPONSES_STORE_SIZE
from nanoserve.settings import add_config_arg
from nanoserve.supervisor.router import ROUTER_POLICIES
from nanoserve.tokenizer.prompt_limits import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from collections.abc import Callable

    from nanoserve.engine.args import EngineArgs
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.runtime.engine_core import EngineInfo

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description="Serve MODEL over an OpenAI-compatible HTTP API (also Anthropic Messages "
                                          "and the Responses API), with a chat page at / and a dashboard at "
                                          "/dashboard.")
    add_model_arg(p)
    add_config_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port of the HTTP API")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/* (default: none)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL, or "
                   f"{DEMO_MODEL_NAME} for the demo model)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="sequences allowed to wait for a slot (a request adds one per prompt and choice: "
                        "prompts times n); a request that would pass it is answered 429 before any work "
                        f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="a connection must send a whole request line and headers within this long of connecting "
                        "(or of its previous response), else it is closed, after a 408 "
                        f"(against slowloris; default: {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_IDLE_TIMEOUT_S, metavar="SECONDS",
                   help=f"close a connection idle this long between requests (default: {DEFAULT_IDLE_TIMEOUT_S})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="a connection opened while N are open gets a 503 (Retry-After) and is closed "
                        f"(default: {DEFAULT_MAX_CONNECTIONS}; keep it below the open-files limit, `ulimit -n`)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted")
    p.add_argument("--tool-call-parser", choices=PARSER_NAMES, default="auto",
                   help=f"how tool calls appear in the model's output: {TOOL_PARSERS.help()}")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default="auto",
                   help=f"return the <think> block of chat replies as reasoning_content: {REASONING_PARSERS.help()}")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send each request's new tokens every N engine steps (and at its first token and its end); "
                        "N > 1 saves serving work at the cost of burstier streams")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins browsers may call the API from (CORS), e.g. https://app.example or *; "
                        "default: none (no CORS headers)")
    p.add_argument("--sse-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
                   help="send a `: keep-alive` comment on a stream silent for this long (0: never)")
    p.add_argument("--prompt-workers", type=int, default=DEFAULT_PROMPT_WORKERS, metavar="N",
                   help="worker processes that render chat templates (half as many, at least one, tokenize plain "
                        f"prompts), so neither holds the server's interpreter lock (default: {DEFAULT_PROMPT_WORKERS})")
    p.add_argument("--prompt-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="a request's template rendering or tokenizing is stopped after this long, a 400 "
                        f"(default: {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--ignore-unknown-fields", action="store_true", default=False,
                   help="log and drop request fields that no OpenAI, vLLM or SGLang API defines (default: a 400 "
                        "naming them); fields those APIs define that nanoserve cannot honour stay a 400")
    p.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20, metavar="MB",
                   help="a larger request body is refused with a 413 before it is parsed "
                        f"(default: {DEFAULT_MAX_BODY_BYTES / 2**20:g})")
    p.add_argument("--engine-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help="restart a dead engine-core process up to N times within 10 minutes (delays 1, 2, 4, ... s); "
                        f"past that the server exits with status 1 (default: {DEFAULT_MAX_RESTARTS})")
    p.add_argument("--responses-store-size", type=int, default=DEFAULT_RESPONSES_STORE_SIZE, metavar="N",
                   help="how many `store: true` responses of /v1/responses to keep in memory, least recently used "
                        "dropped first (0: store none); they do not survive a restart")
    p.add_argument("--engine-core", choices=("process", "thread"), default="process",
                   help="run the engine in a process of its own (default: the HTTP side and the engine then do not "
                        "share one interpreter lock) or on a thread of the server process")
    scale = p.add_argument_group("data parallel (docs/scale_out.md)")
    scale.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="run N replicas (on 127.0.0.1, ports PORT+1..PORT+N, the cores split between them) "
                            "behind sglang-router on --host/--port; its metrics on PORT+N+1")
    scale.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware",
                       help="with --data-parallel-size > 1: cache_aware (a request goes to the replica that has "
                            "most of its prefix cached) or round_robin")
    add_engine_args(p)
    p.set_defaults(func=run, serve_parser=p)


def run(ns: argparse.Namespace) -> int:
    args = preflight(ns)
    if ns.data_parallel_size != 1:
        return _run_data_parallel(ns)
    if args.node_rank > 0:  # a further node of a tensor-parallel engine: its worker ranks only
        from nanoserve.parallel.worker import run_node_workers

        return run_node_workers(args)
    listener = bind(ns.host, ns.port)
    return _serve(ns, args, listener)


def preflight(ns: argparse.Namespace) -> EngineArgs:
    """What can be checked before anything loads: the engine's flags agree (EngineArgs validates
    them), the model and the draft model name something that exists and is readable. Raises
    ValueError or ModelLoadError with one line saying what to fix."""
    args = engine_args_from(ns)
    source_kind(args.model)
    if args.speculative_model is not None:
        source_kind(args.speculative_model)
    return args


def bind(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (as uvicorn binds, SO_REUSEADDR) so that a port in
    use is reported before the model loads; ValueError naming the port when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        advice = "pick another --port, or stop what listens there" if e.errno == errno.EADDRINUSE else "check --host"
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} ({advice})") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _serve(ns: argparse.Namespace, args: EngineArgs, listener: socket.socket) -> int:
    started = time.monotonic()
    name = ns.served_model_name or ns.model or DEMO_MODEL_NAME
    log.info("nanoserve %s: serving %s on %s; importing the server and the engine",
             importlib.metadata.version("nanoserve"), name, api_url(ns.host, listener.getsockname()[1]))

    # Ctrl-C while importing: no process started yet and nothing to undo, so it exits at once.
    # KeyboardInterrupt would not do: a library's bare `except:` around an optional import of its
    # own can take it, and the start would go on.
    previous = signal.signal(signal.SIGINT, _interrupted)
    from nanoserve.runtime.builder import build_engine
    from nanoserve.runtime.engine_core import EngineState
    from nanoserve.server import ServerConfig, build_app
    from nanoserve.server.connection_limits import ConnectionLimits, LimitedConfig
    from nanoserve.server.http_server import DrainingServer, serve_until_signal
    signal.signal(signal.SIGINT, previous)

    def shut_down() -> None:
        server.should_exit = True  # nothing to serve (see the check below)

    def on_ready(info: EngineInfo) -> None:
        log.info("%s", ready_line(api_url(ns.host, listener.getsockname()[1]), name, info,
                                  time.monotonic() - started))

    engine: EngineArgs | Callable[[], LLMEngine] = args
    if ns.engine_core == "thread":
        engine = functools.partial(build_engine, args)
    config = ServerConfig(name, ns.api_key, ns.max_queued_requests, ns.tool_call_parser, ns.stream_interval,
                          reasoning_parser=ns.reasoning_parser, allowed_origins=tuple(ns.allowed_origins),
                          sse_keep_alive_s=ns.sse_keep_alive or None, prompt_workers=ns.prompt_workers,
                          prompt_timeout_s=ns.prompt_timeout, ignore_unknown_fields=ns.ignore_unknown_fields,
                          engine_restarts=ns.engine_restarts, max_body_bytes=int(ns.max_request_body_mb * 2**20),
                          responses_store_size=ns.responses_store_size)
    app = build_app(engine, config, on_fatal=shut_down, on_ready=on_ready)
    limits = ConnectionLimits(ns.header_timeout, ns.timeout_keep_alive, ns.max_connections)
    server = DrainingServer(LimitedConfig(app, limits, timeout_graceful_shutdown=ns.shutdown_timeout,
                                          log_config=None, log_level=None))
    log.info("loading the model in the engine's %s; /health answers 503 until it is ready", ns.engine_core)
    serve_until_signal(server, sockets=[listener])
    front = app.state.engine
    if front.state is EngineState.DEAD:
        what = "loading the model failed" if front.info is None else "the engine died past its restarts"
        print(f"nanoserve: error: {what}: {front.error}", file=sys.stderr)
        return 1
    return 0


def _interrupted(sig: int, frame: object) -> None:
    """SIGINT's handler while `serve` imports: says so and exits 130 (as the CLI does on Ctrl-C)."""
    print("nanoserve: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def api_url(host: str, port: int) -> str:
    """The server's base URL as a client on this machine would write it."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}"


def ready_line(url: str, name: str, info: EngineInfo, seconds: float) -> str:
    """The one line that says the server is ready: where to reach it and what it serves."""
    limits = info.limits
    what = ""
    if (s := info.summary) is not None:
        what = (f"dtype {s.dtype}, weights {', '.join(s.weight_formats) or 'dense'}, "
                f"{s.threads} thread{'s' if s.threads != 1 else ''}, ")
    return (f"ready in {seconds:.1f} s: API {url}/v1, chat page {url}/, dashboard {url}/dashboard; model {name}, "
            f"{what}KV capacity {limits.num_blocks * limits.block_size} tokens ({limits.num_blocks} blocks of "
            f"{limits.block_size})")


# Flags of the data-parallel supervisor itself, never passed on to a replica (each gets its own host and port).
_SUPERVISOR_ONLY = frozenset({"host", "port", "data_parallel_size", "router_policy", "help"})


def _run_data_parallel(ns: argparse.Namespace) -> int:
    """`serve --data-parallel-size N`: the replicas, each `nanoserve serve` with this command's
    other flags, behind the router (nanoserve.supervisor.data_parallel)."""
    if ns.tensor_parallel_size != 1 or ns.nnodes != 1:
        raise ValueError("--data-parallel-size with --tensor-parallel-size or --nnodes is not supported: the "
                         "replicas would share one rendezvous port; run tensor-parallel replicas one by one "
                         "and start the router yourself (docs/scale_out.md)")
    from nanoserve.supervisor.data_parallel import DataParallelPlan, available_cpus, serve_data_parallel
    from nanoserve.supervisor.router import require_router

    plan = DataParallelPlan.for_cpus(ns.host, ns.port, ns.data_parallel_size, ns.router_policy, available_cpus())
    require_router()
    flags = replica_argv(ns.serve_parser, ns)

    def replica_command(host: str, port: int) -> list[str]:
        return [sys.executable, "-m", "nanoserve.cli", "--log-level", ns.log_level, "serve", *flags,
                "--host", host, "--port", str(port), "--data-parallel-size", "1"]

    return serve_data_parallel(plan, replica_command, ns.shutdown_timeout, ns.log_level, ns.api_key)


def replica_argv(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> list[str]:
    """Arguments that `parser` parses back to the values of `ns` (those of the supervisor-only flags
    aside): the positional model first, then every option whose value is not its default."""
    out: list[str] = []
    positional: list[str] = []
    for action in parser._actions:
        value: Any = getattr(ns, action.dest, None)
        if action.dest in _SUPERVISOR_ONLY or value == action.default:
            continue
        if not action.option_strings:
            positional.append(str(value))
        elif isinstance(action, argparse.BooleanOptionalAction):
            out.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(value, list):
            out.extend([action.option_strings[0], *map(str, value)])
        else:
            out.extend([action.option_strings[0], str(value)])
    return positional + out
