"""`nanoserve bench`: benchmarks. `bench throughput` runs random requests through the engine offline
(optionally beside peers, with the rooflines); `bench serve` load-tests an OpenAI-compatible server;
`bench shape` prints the folder of a `--model-shape` preset (to serve it); `bench structured`
compares decode steps constrained by a JSON schema with unconstrained ones; `bench quant` runs
nanoserve and llama.cpp on the same BF16, Q8_0 and Q4_K_M GGUF files (or other llama.cpp file types)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from nanoserve.bench.peers import PEERS, check_peers
from nanoserve.bench.shapes import PRESETS, parse_overrides, shape_checkpoint
from nanoserve.bench.structured import format_costs, structured_step_costs
from nanoserve.bench.throughput import COMPARISONS, ThroughputConfig, run_throughput
from nanoserve.bench.workloads import WORKLOADS
from nanoserve.commands.bench_spec import register_spec
from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks")
    kinds = p.add_subparsers(dest="bench", required=True)
    t = kinds.add_parser("throughput", help="offline engine throughput over random requests",
                         description="N requests with random prompt token ids and random output lengths "
                                     "(greedy, ignore_eos) through one engine; prints requests/s and tokens/s. "
                                     "--max-model-len defaults to the longest request the ranges allow, --threads "
                                     "to 1 with --stand-in (its tensors are tiny).")
    add_model_arg(t)
    t.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    t.add_argument("--input-len-range", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]")
    t.add_argument("--output-len-range", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX]")
    t.add_argument("--stand-in", action="store_true",
                   help="use the deterministic stand-in model (no weights): measures engine bookkeeping")
    t.add_argument("--compare", choices=COMPARISONS,
                   help="sequential: the same requests one at a time; contiguous: paged vs contiguous KV "
                        "layout under the same pool (max_model_len 2048 unless given)")
    t.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    _add_shape_args(t)
    _add_peer_args(t)
    t.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure and print the machine's GEMM peak and memory bandwidth, and each run's fraction")
    t.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="then rerun the workload and print torch.profiler's op table over N steps after admission")
    add_engine_args(t)
    t.set_defaults(func=run)
    _register_serve(kinds)
    register_spec(kinds)
    _register_structured(kinds)
    _register_quant(kinds)
    s = kinds.add_parser("shape", help="print the folder of a --model-shape preset (written on first use)")
    s.add_argument("name", choices=sorted(PRESETS))
    s.add_argument("--shape-override", nargs="+", default=[], metavar="KEY=VALUE", help="config fields to replace")
    s.set_defaults(func=lambda ns: print(shape_checkpoint(ns.name, parse_overrides(ns.shape_override))) or 0)


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-shape", choices=sorted(PRESETS),
                   help="a random-weight checkpoint with this real model's exact shape (instead of MODEL)")
    p.add_argument("--shape-override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config fields to replace in the --model-shape preset (e.g. num_hidden_layers=2)")


def _add_peer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", nargs="+", default=[], choices=PEERS, metavar="PEER",
                   help=f"also run these on the same weights and requests: {', '.join(PEERS)}")
    p.add_argument("--peer-batch-sizes", type=int, nargs="+", metavar="B",
                   help="batch sizes of hf-static and hf-cb (default: max-num-seqs, or each --max-concurrency)")
    p.add_argument("--peer-prompts", type=int, metavar="N",
                   help="one-at-a-time peers (hf-sequential, llama.cpp) run only the first N requests")


def _shape_model(ns: argparse.Namespace) -> str | None:
    """The model folder: the --model-shape preset's when given, else MODEL."""
    if ns.model_shape is None:
        if ns.shape_override:
            raise ValueError("--shape-override needs --model-shape")
        return ns.model
    if ns.model is not None:
        raise ValueError("give either MODEL or --model-shape, not both")
    return str(shape_checkpoint(ns.model_shape, parse_overrides(ns.shape_override)))


def run(ns: argparse.Namespace) -> int:
    threads = 1 if ns.threads is None and ns.stand_in else ns.threads
    if threads is not None:
        torch.set_num_threads(threads)
    ns.model = _shape_model(ns)
    cfg = ThroughputConfig(engine_args_from(ns), ns.num_prompts, tuple(ns.input_len_range),
                           tuple(ns.output_len_range), ns.stand_in, ns.compare, tuple(ns.peers),
                           tuple(ns.peer_batch_sizes or ()), ns.peer_prompts, ns.roofline, ns.profile_steps)
    report = run_throughput(cfg)
    print(report.format())
    _write_json(ns.json, report.to_dict())
    return 0


def _register_structured(kinds: argparse._SubParsersAction) -> None:
    g = kinds.add_parser("structured", help="per-step cost of structured output (JSON schema) vs unconstrained",
                         description="Decode steps of B sequences all constrained by a JSON schema against the "
                                     "same B unconstrained, alternating, median step of each.")
    add_model_arg(g)
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64], metavar="B")
    g.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    g.add_argument("--rounds", type=int, default=3, help="alternations of the two runs per batch size")
    _add_shape_args(g)
    add_engine_args(g)
    g.set_defaults(func=_run_structured)


def _run_structured(ns: argparse.Namespace) -> int:
    from nanoserve.runtime.builder import build_engine

    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    ns.model = _shape_model(ns)
    args = engine_args_from(ns)
    largest = max(ns.batch_sizes)
    overrides: dict[str, Any] = {"max_num_seqs": max(args.max_num_seqs, largest)}
    if args.max_model_len is None:
        overrides["max_model_len"] = 32 + ns.steps + 64
    engine = build_engine(dataclasses.replace(args, **overrides))
    print(format_costs(structured_step_costs(engine, tuple(ns.batch_sizes), ns.steps, rounds=ns.rounds)))
    return 0


def _register_quant(kinds: argparse._SubParsersAction) -> None:
    from nanoserve.bench.quant import DEFAULT_FORMATS, DEFAULT_SHAPES, ENGINES, FORMATS, QuantBenchConfig

    q = kinds.add_parser("quant", help="nanoserve vs llama.cpp on the same BF16, Q8_0 and Q4_K_M GGUF files",
                         description="For each model shape (random weights): a BF16 GGUF and the Q8_0 and Q4_K_M "
                                     "files llama.cpp quantizes from it (cached); each engine on each file in its "
                                     "own process: single-stream and batched decode tok/s, resident memory, the "
                                     "fraction of the memory-bandwidth roofline.")
    d: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(QuantBenchConfig)}  # the class defaults
    q.add_argument("--model-shape", nargs="+", choices=sorted(PRESETS), default=list(DEFAULT_SHAPES))
    q.add_argument("--shape-override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config fields to replace in every shape (e.g. num_hidden_layers=2)")
    q.add_argument("--formats", nargs="+", type=str.upper, choices=FORMATS, default=list(DEFAULT_FORMATS),
                   help="the files, by llama.cpp's file type (default: %(default)s)")
    q.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    q.add_argument("--prompt-len", type=int, default=d["prompt_len"], help="prompt tokens of every request")
    q.add_argument("--single-tokens", type=int, default=d["single_tokens"], help="output tokens, single stream")
    q.add_argument("--batch-tokens", type=int, default=d["batch_tokens"], help="output tokens per request, batched")
    q.add_argument("--batch-sizes", type=int, nargs="*", default=list(d["batch_sizes"]), metavar="B")
    q.add_argument("--repeats", type=int, default=d["repeats"], help="single-stream runs per file (median reported)")
    q.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="threads of both engines and of the roofline measurement")
    q.add_argument("--engine-option", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra EngineArgs fields for nanoserve (e.g. quantization=int8)")
    q.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the memory bandwidth and print each single stream's fraction of it")
    q.add_argument("--llama-cpp-extra-buffers", action=argparse.BooleanOptionalAction, default=None,
                   help="llama.cpp's use_extra_bufts (AMX and repacked weights; default: on, but off on CPUs with "
                        "AMX-INT8, where its AMX product crashes on quantized files)")
    q.add_argument("--out", type=Path, metavar="DIR", help="write quant.json and a plot per shape there")
    q.set_defaults(func=_run_quant)


def _run_quant(ns: argparse.Namespace) -> int:
    from nanoserve.bench.quant import QuantBenchConfig, run_quant_bench

    cfg = QuantBenchConfig(tuple(ns.model_shape), tuple(ns.formats), tuple(ns.engines), ns.prompt_len,
                           ns.single_tokens, ns.batch_tokens, tuple(ns.batch_sizes), ns.repeats, ns.threads,
                           overrides=parse_overrides(ns.shape_override),
                           engine_options=parse_overrides(ns.engine_option), roofline=ns.roofline,
                           llama_cpp_extra_buffers=ns.llama_cpp_extra_buffers)
    report = run_quant_bench(cfg)
    print()
    print(report.format())
    if ns.out is not None:
        _write_json(ns.out / "quant.json", report.to_dict())
        for path in report.plot(ns.out):
            print(f"plot: {path}")
    return 0


def _write_json(path: Path | None, obj: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def _register_serve(kinds: argparse._SubParsersAction) -> None:
    v = kinds.add_parser("serve", help="load-test an OpenAI-compatible server (ours or another)",
                         description="Streams synthetic requests to a running server at a fixed concurrency or "
                                     "a Poisson request rate and reports throughput and TTFT/TPOT/ITL/E2E "
                                     "latencies. Several values of --max-concurrency or --request-rate make a "
                                     "sweep; several --url values run the same workload against each server. "
                                     "With --peer llama-server it starts nanoserve and llama-server itself on each "
                                     "of --models and compares them (nanoserve.bench.served).")
    v.add_argument("--url", nargs="+", help="base URL(s) of the server(s), e.g. http://127.0.0.1:8000 (required "
                                            "without --peer)")
    v.add_argument("--label", nargs="+", help="a name per URL for the tables (default: the URL)")
    v.add_argument("--served-model-name", help="the model name to send (default: the first /v1/models lists)")
    v.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"), help="sent as a Bearer token")
    v.add_argument("--endpoint", choices=["completions", "chat"], default=None,
                   help="completions (default) or chat (the default for multi-turn)")
    v.add_argument("--workload", choices=WORKLOADS, default="random")
    v.add_argument("--num-prompts", type=int, nargs="+", metavar="N",
                   help="requests (multi-turn: conversations); one value, or one per --max-concurrency "
                        "(default: 64; with --peer: 2 C, at least 4)")
    v.add_argument("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="prompt tokens (shared-prefix: question tokens; multi-turn: per user turn) (default: 32 "
                        "256; with --peer: per concurrency as in nanoserve.bench.served.POINTS, or MIN = MAX)")
    v.add_argument("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="output tokens per request (default: 32 256; with --peer: as --input-len-range)")
    v.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: tokens per system prompt")
    v.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: K system prompts")
    v.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    v.add_argument("--max-concurrency", type=int, nargs="+", default=[None], metavar="C",
                   help="requests in flight at most (several: a sweep; default: no limit)")
    v.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], metavar="R",
                   help="Poisson arrivals per second (several: a sweep; default inf: all at once)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--tokenizer", help="folder with the server's tokenizer.json, to build and count prompts "
                                       "(default: --peer-model, the --model-shape folder or the demo model)")
    v.add_argument("--peer-model", help="the weights the server runs (HF folder), for --peers; hf-static and "
                                        "hf-cb run each --max-concurrency's workload at that batch size")
    v.add_argument("--dtype", default="auto", help="the server's dtype: the peers' and the rooflines'")
    v.add_argument("--threads", type=int, help="torch threads of the peers and the roofline measurement "
                                              "(match the server's)")
    v.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True,
                   help="with the model known (--peer-model, --model-shape), measure and print the rooflines")
    v.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    v.add_argument("--plot-throughput", type=Path, metavar="PNG", help="plot output tok/s against concurrency")
    v.add_argument("--plot-ttft", type=Path, metavar="PNG", help="plot median TTFT against request rate")
    _add_shape_args(v)
    _add_peer_args(v)
    from nanoserve.bench.served import MODELS

    w = v.add_argument_group("serving peer (--peer): the servers started here, side by side")
    w.add_argument("--peer", choices=["llama-server", "none"],
                   help="start nanoserve and this server on each of --models and drive both with the same client "
                        "(none: the nanoserve servers only)")
    w.add_argument("--models", nargs="+", default=list(MODELS), metavar="MODEL",
                   help="GGUF files to serve: SHAPE:FORMAT (random weights), a catalogue name or a .gguf path")
    w.add_argument("--nanoserve-tree", nargs="+", default=[], metavar="LABEL=PATH",
                   help="run nanoserve from these source trees under these labels (default: this one, as "
                        "'nanoserve'); several alternate, to measure a change against the code before it")
    w.add_argument("--nanoserve-flags", nargs="+", default=[], metavar="LABEL=FLAGS",
                   help="extra `nanoserve serve` flags of a --nanoserve-tree label, e.g. 'shared=--prefill-order "
                        "shared'")
    w.add_argument("--port", type=int, default=18480, help="the first loopback port of the servers")
    w.add_argument("--server-logs", type=Path, metavar="DIR", help="keep the servers' logs there")
    v.set_defaults(func=run_serve, model=None)


def _conversations(ns: argparse.Namespace, sampler: Any, n: int) -> list[Any]:
    from nanoserve.bench import workloads as w

    ins, outs = tuple(ns.input_len_range), tuple(ns.output_len_range)
    if ns.workload == "shared-prefix":
        per_prefix = math.ceil(n / ns.num_prefixes)
        return w.shared_prefix_workload(sampler, ns.num_prefixes, per_prefix, ns.prefix_len, ins, outs)
    if ns.workload == "multi-turn":
        return w.multi_turn_workload(sampler, n, ns.turns, ins, outs)
    return w.random_workload(sampler, n, ins, outs)


def _shared_fraction(convs: list[Any], sampler: Any, prompt_tokens: int) -> float:
    """The best hit rate any prefix cache can reach: every request's system prompt tokens but for
    the first request of each prefix, over all prompt tokens (as the server counted them)."""
    seen: set[int] = set()
    shared = 0
    for c in convs:
        if c.prefix_id in seen:
            shared += sampler.count(c.system)
        seen.add(c.prefix_id)
    return shared / prompt_tokens if prompt_tokens else 0.0


def _token_workload(tok: Any, endpoint: str, convs: list[Any]) -> Any:
    """The single-turn conversations as the server tokenizes them, for the peers."""
    from nanoserve.bench.workloads import Workload

    ids = tuple(tuple(tok.encode_chat(c.messages(0, [])) if endpoint == "chat" else tok.encode(c.prompt(0, [])))
                for c in convs)
    return Workload(ids, tuple(c.output_lens[0] for c in convs))


def _sweep(ns: argparse.Namespace, sampler: Any) -> tuple[list[tuple[int | None, float]], list[list[Any]]]:
    """The points of the sweep, (max concurrency, request rate), and each point's conversations:
    fresh prompts for every point (the same for every server), so that a server's prefix cache
    never serves one point's prompts from an earlier point's."""
    if len(ns.num_prompts) not in (1, len(ns.max_concurrency)):
        raise ValueError("give one --num-prompts, or one per --max-concurrency")
    per_point = ns.num_prompts if len(ns.num_prompts) > 1 else ns.num_prompts * len(ns.max_concurrency)
    counts = dict(zip(ns.max_concurrency, per_point, strict=True))
    points = [(c, r) for c in ns.max_concurrency for r in ns.request_rate]
    workloads = []
    for i, (conc, _) in enumerate(points):
        sampler.rng.seed(ns.seed + i)
        workloads.append(_conversations(ns, sampler, counts[conc]))
    return points, workloads


def _peer_runs(ns: argparse.Namespace, tok: Any, endpoint: str, peer_model: str,
               points: list[tuple[int | None, float]], workloads: list[list[Any]]) -> list[dict[str, Any]]:
    """hf-static / hf-cb at each concurrency of the sweep on that point's requests (or at
    --peer-batch-sizes on the largest workload); one-at-a-time peers on the largest workload."""
    from nanoserve.bench.peers import run_peers
    from nanoserve.bench.serve import peer_summary
    from nanoserve.model.checkpoint.loader import resolve_dtype

    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    largest = max(workloads, key=len)
    by_batch = {b: largest for b in ns.peer_batch_sizes or ()}
    by_batch = by_batch or {c: w for (c, _), w in zip(points, workloads, strict=True) if c} or {len(largest): largest}
    peer_workloads = {b: _token_workload(tok, endpoint, w) for b, w in by_batch.items()}
    dtype = resolve_dtype(ns.dtype, torch.device("cpu"))
    peers = []
    for run in run_peers(tuple(ns.peers), Path(peer_model), dtype, peer_workloads, 2048, ns.peer_prompts):
        name, _, batch = run.label.rpartition("-")
        peer, b = (name, int(batch)) if batch.isdigit() else (run.label, run.peak_running)
        peers.append(peer_summary(run, peer, b))
    return peers


def _serving_roofline(ns: argparse.Namespace, model_dir: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Measures the rooflines in the --dtype and --threads given (they should be the server's),
    prints where the runs stand under them and returns them."""
    from nanoserve.bench.roofline import RooflineReport, measure_roofline
    from nanoserve.bench.throughput import format_table
    from nanoserve.model.checkpoint.loader import resolve_dtype
    from nanoserve.model.config import ModelConfig

    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    cfg = ModelConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text()))
    dtype = resolve_dtype(ns.dtype, torch.device("cpu"))
    report = RooflineReport.of(measure_roofline(dtype, cfg.hidden_size), cfg, dtype)
    print("", *report.describe(), format_table(*report.serving_table(runs)), sep="\n")
    return {**report.roofline.to_dict(), "decode_params": report.params, "weight_bytes": report.weight_bytes}


# `bench serve` flags that --peer honours; every other one must keep its default there.
_PEER_FLAGS = {"peer", "models", "nanoserve_tree", "nanoserve_flags", "port", "server_logs", "num_prompts",
               "max_concurrency", "input_len_range", "output_len_range", "seed", "threads", "roofline", "json",
               "plot_throughput"}
_PEER_ONLY = {"models", "nanoserve_tree", "nanoserve_flags", "port", "server_logs"}


def _flags_off_default(ns: argparse.Namespace, parser_defaults: dict[str, Any], names: set[str]) -> list[str]:
    return ["--" + k.replace("_", "-") for k in sorted(names) if getattr(ns, k) != parser_defaults[k]]


def run_serve(ns: argparse.Namespace) -> int:
    defaults = build_serve_defaults()
    if ns.peer is not None:
        unused = _flags_off_default(ns, defaults, set(defaults) - _PEER_FLAGS)
        if unused:
            raise ValueError(f"{', '.join(unused)} not used with --peer (it starts its own servers)")
        return _run_served(ns)
    unused = _flags_off_default(ns, defaults, _PEER_ONLY)
    if unused:
        raise ValueError(f"{', '.join(unused)} only apply with --peer")
    if not ns.url:
        raise ValueError("give --url (a running server), or --peer llama-server")
    ns.num_prompts = ns.num_prompts or [64]
    ns.input_len_range, ns.output_len_range = ns.input_len_range or (32, 256), ns.output_len_range or (32, 256)
    return _run_load_test(ns)


def build_serve_defaults() -> dict[str, Any]:
    """The defaults of every `bench serve` flag, from a parser built here."""
    parser = argparse.ArgumentParser()
    _register_serve(parser.add_subparsers())
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest: a.default for a in serve._actions if a.dest not in ("help",)}


def _run_served(ns: argparse.Namespace) -> int:
    from nanoserve.bench.served import LLAMA_SERVER, ServedConfig, run_served

    trees, flags = _labelled(ns.nanoserve_tree, "--nanoserve-tree", "PATH"), \
        _labelled(ns.nanoserve_flags, "--nanoserve-flags", "FLAGS")
    lengths = None
    if ns.input_len_range or ns.output_len_range:
        ins, outs = ns.input_len_range or (0, 1), ns.output_len_range or (0, 1)
        if ns.input_len_range is None or ns.output_len_range is None or ins[0] != ins[1] or outs[0] != outs[1]:
            raise ValueError("with --peer, give both --input-len-range and --output-len-range, each with MIN = MAX")
        lengths = (ins[0], outs[0])
    concurrency = tuple(c for c in ns.max_concurrency if c is not None)
    default = ServedConfig()
    paths = {label: Path(path) for label, path in trees.items()} or dict(default.nanoserve_trees)
    cfg = ServedConfig(
        models=tuple(ns.models), concurrency=concurrency or default.concurrency,
        num_prompts=tuple(ns.num_prompts or ()), lengths=lengths, threads=ns.threads or 2, seed=ns.seed,
        port=ns.port, roofline=ns.roofline, nanoserve_trees=paths,
        nanoserve_flags={label: tuple(shlex.split(f)) for label, f in flags.items()},
        servers=(*paths, *([LLAMA_SERVER] if ns.peer == LLAMA_SERVER else [])))
    # A terminated run still stops the servers it started (SIGTERM as SystemExit, through `finally`).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = run_served(cfg, ns.server_logs)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print()
    print(report.format())
    _write_json(ns.json, report.to_dict())
    if ns.plot_throughput:
        report.plot(ns.plot_throughput)
        print(f"plot: {ns.plot_throughput}")
    return 0


def _labelled(items: list[str], flag: str, what: str) -> dict[str, str]:
    """LABEL=VALUE items as a dict; ValueError naming `flag` for one without a label or value."""
    pairs = [item.partition("=") for item in items]
    if any(not label or not sep or not value for label, sep, value in pairs):
        raise ValueError(f"{flag} needs LABEL={what}")
    return {label: value for label, _, value in pairs}


def _run_load_test(ns: argparse.Namespace) -> int:
    from nanoserve.bench.serve import LoadConfig, format_summaries, run_load
    from nanoserve.bench.workloads import TextSampler
    from nanoserve.model.checkpoint.loader import resolve_source
    from nanoserve.tokenizer import Tokenizer

    labels = ns.label or ns.url
    if len(labels) != len(ns.url):
        raise ValueError("give one --label per --url")
    peer_model = ns.peer_model or _shape_model(ns)
    if ns.peers and peer_model is None:
        raise ValueError("--peers need the server's weights: --peer-model DIR or --model-shape")
    if ns.peers and ns.workload == "multi-turn":
        raise ValueError("--peers run single-turn workloads only")
    check_peers(tuple(ns.peers))
    tok_dir = Path(ns.tokenizer or peer_model or resolve_source(None))
    tok = Tokenizer.from_pretrained_dir(tok_dir)
    sampler = TextSampler(tok, ns.seed)
    points, workloads = _sweep(ns, sampler)
    endpoint = ns.endpoint or ("chat" if ns.workload == "multi-turn" else "completions")
    runs = []
    for url, label in zip(ns.url, labels, strict=True):
        for (conc, rate), convs in zip(points, workloads, strict=True):
            cfg = LoadConfig(url, label, ns.served_model_name, endpoint, conc, rate, ns.seed, ns.api_key)
            summary = asyncio.run(run_load(cfg, convs, sampler.count)).summary()
            if ns.workload == "shared-prefix":
                summary["shared_fraction"] = _shared_fraction(convs, sampler, summary["prompt_tokens"])
            runs.append(summary)
            print(f"{label} c={conc or '-'} r={rate:g}: {summary['output_tokens_per_s']:.1f} output tok/s, "
                  f"TTFT p50 {summary['ttft_ms']['p50']:.0f} ms", flush=True)
    peers: list[dict[str, Any]] = []
    if ns.peers:
        assert peer_model is not None  # refused above
        peers = _peer_runs(ns, tok, endpoint, peer_model, points, workloads)
    print()
    print(format_summaries(runs, peers))
    roof = _serving_roofline(ns, peer_model, runs + peers) if peer_model and ns.roofline else None
    info = {"workload": ns.workload, "endpoint": endpoint,
            "requests_per_point": [sum(len(c.user_turns) for c in w) for w in workloads],
            "tokenizer": str(tok_dir), "load_average": os.getloadavg(), "torch_threads": torch.get_num_threads(),
            "args": {k: v for k, v in vars(ns).items() if k not in ("func", "api_key")}}
    _write_json(ns.json, {"config": info, "runs": runs, "peers": peers, "roofline": roof})
    model = ns.model_shape or Path(peer_model or tok_dir).name
    lens = f"prompts {ns.input_len_range[0]}-{ns.input_len_range[1]}, outputs {ns.output_len_range[0]}-" \
           f"{ns.output_len_range[1]} tokens"
    title = f"{model}, {ns.workload} workload ({lens}), {torch.get_num_threads()} torch thread(s)"
    if ns.plot_throughput:
        from nanoserve.bench.plots import plot_throughput

        plot_throughput(runs, peers, ns.plot_throughput, title)
    if ns.plot_ttft:
        from nanoserve.bench.plots import plot_ttft

        plot_ttft(runs, peers, ns.plot_ttft, title, ns.seed)
    return 0
