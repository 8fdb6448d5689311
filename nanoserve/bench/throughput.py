"""Offline engine throughput: random requests through one engine with continuous batching.

`run_throughput` builds an engine (a checkpoint, the demo model or the deterministic stand-in),
runs `num_prompts` requests with random prompt token ids and random output lengths (greedy,
ignore_eos, so each yields exactly its output length) and measures, per run:

- requests/s, output tokens/s and total (prompt + output) tokens/s over the whole run;
- engine steps/s, and decode tokens/s over the pure-decode steps (every scheduled sequence
  decodes one token, nobody is admitted or preempted). With the stand-in the model costs next to
  nothing, so this is the rate of the engine's own bookkeeping (scheduler, KV manager, batch
  preparation, sampler, postprocess);
- the peak number of sequences running at once, and the number of preemptions.

Comparisons run in the same process on the same workload:
- `sequential`: the same requests one at a time on a fresh engine;
- `contiguous`: the paged and the contiguous KV layout over the same pool (same number of
  blocks of the same size), max_model_len 2048 unless given: how many sequences each admits.

Every run gets a fresh engine, warmed up with two short requests before the clock starts.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.bench.roofline import RooflineReport, measure_roofline
from nanoserve.bench.run_stats import RunStats
from nanoserve.bench.workloads import Workload
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import CausalLM, load_model
from nanoserve.model.checkpoint.loader import resolve_source
from nanoserve.runtime.builder import build_engine
from nanoserve.runtime.stand_in import stand_in_engine

COMPARISONS = ("sequential", "contiguous")
CONTIGUOUS_MAX_MODEL_LEN = 2048
CONTIGUOUS_POOL_SEQUENCES = 8  # default pool for --compare contiguous: this many max-length sequences

EngineFactory = Callable[[EngineArgs], LLMEngine]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine, stats: RunStats, submitted: dict[str, float]) -> None:
    """Steps the engine until it is idle, counting into `stats`; `submitted` holds when each
    request was added, and each finished request's (first token, last token) latencies are
    appended to `stats.latencies`."""
    first: dict[str, float] = {}
    while engine.has_unfinished():
        before, decoding = engine.num_running_seqs, engine.num_decoding_seqs()
        all_decoding, prefill_only = decoding == before, decoding == 0
        live = engine.sequence_progress() if prefill_only or all_decoding else {}
        context = sum(p.num_tokens for p in live.values() if p.running) if all_decoding else 0
        start = time.perf_counter()
        deltas = engine.step().deltas
        now = time.perf_counter()
        seconds = now - start
        finished = sum(d.finished for d in deltas)
        tokens = sum(len(d.token_ids) for d in deltas)
        stats.steps += 1
        stats.output_tokens += tokens
        running_after = engine.num_running_seqs
        stats.peak_running = max(stats.peak_running, running_after + finished)
        # Admission never happens in a step that preempts, so an unchanged count means neither did.
        if before and all_decoding and len(deltas) == before == running_after + finished:
            stats.decode_steps += 1
            stats.decode_tokens += tokens
            stats.decode_context_tokens += context
            stats.decode_s += seconds
        elif prefill_only:
            # A sequence gone after the step finished in it, having computed all it had.
            after = engine.sequence_progress()
            stats.prefill_tokens += sum(
                max(0, after[key].num_computed_tokens - p.num_computed_tokens) if key in after
                else p.num_tokens - p.num_computed_tokens for key, p in live.items())
            stats.prefill_s += seconds
        for d in deltas:
            first.setdefault(d.request_id, now)
            if d.finished:
                t0 = submitted[d.request_id]
                stats.latencies.append((first[d.request_id] - t0, now - t0))


def _submit(engine: LLMEngine, workload: Workload, label: str, indices: range) -> dict[str, float]:
    """Adds the requests; returns when each was added, by request id."""
    submitted = {}
    for i in indices:
        engine.add_request(f"{label}-{i}", list(workload.prompts[i]), _greedy(workload.output_lens[i]))
        submitted[f"{label}-{i}"] = time.perf_counter()
    return submitted


def _run(engine: LLMEngine, workload: Workload, label: str, batches: list[range]) -> RunStats:
    """Submits each batch of requests once the previous one has finished."""
    stats = RunStats(label, requests=len(workload.prompts), prompt_tokens=sum(map(len, workload.prompts)))
    preemptions = engine.num_preemptions
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        _drain(engine, stats, _submit(engine, workload, label, batch))
    stats.elapsed_s, stats.cpu_s = time.perf_counter() - start, time.process_time() - cpu
    stats.preemptions = engine.num_preemptions - preemptions
    return stats


def run_batched(engine: LLMEngine, workload: Workload, label: str) -> RunStats:
    """All requests submitted at once; the scheduler batches them."""
    return _run(engine, workload, label, [range(len(workload.prompts))])


def run_sequential(engine: LLMEngine, workload: Workload, label: str = "sequential") -> RunStats:
    """The same requests one at a time: each is submitted when the previous one has finished."""
    return _run(engine, workload, label, [range(i, i + 1) for i in range(len(workload.prompts))])


def profile_steps(engine: LLMEngine, workload: Workload, num_steps: int, row_limit: int = 25) -> str:
    """Where step time goes: torch.profiler (CPU, and CUDA on a GPU) over `num_steps` engine steps
    taken once no request waits for admission, so mostly decode; the ops by self time (device time
    on CUDA). The requests are then drained unprofiled."""
    _submit(engine, workload, "profile", range(len(workload.prompts)))
    while engine.num_waiting:
        engine.step()
    cuda = engine.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    steps = 0
    with torch.profiler.profile(activities=activities) as prof:
        while steps < num_steps and engine.has_unfinished():
            engine.step()
            steps += 1
    while engine.has_unfinished():
        engine.step()
    table = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                      row_limit=row_limit)
    return f"profile of {steps} steps after admission ({len(workload.prompts)} requests):\n{table}"


def warm_up(engine: LLMEngine, seed: int) -> None:
    """Two short requests (up to 16 + 4 tokens), so that first-call costs stay out of the measurement."""
    rng = random.Random(seed ^ 0x5EED)
    vocab, total = engine.vocab_size, min(20, engine.max_model_len)
    prompt_len = max(1, total - 4)
    for i in range(2):
        engine.add_request(f"warmup-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                           _greedy(total - prompt_len))
    while engine.has_unfinished():
        engine.step()


def engine_factory(args: EngineArgs, stand_in: bool) -> EngineFactory:
    """Builds engines for variants of `args`, loading the model (if any) only once."""
    if stand_in:
        return lambda a: stand_in_engine(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)})
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    return lambda a: build_engine(a, loaded)


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """What to run. `args.max_model_len` defaults to the longest request the ranges allow (2048
    for the contiguous comparison); the contiguous comparison's pool defaults to
    CONTIGUOUS_POOL_SEQUENCES max-length sequences."""

    args: EngineArgs
    num_prompts: int = 64
    input_len_range: tuple[int, int] = (32, 256)
    output_len_range: tuple[int, int] = (32, 256)
    stand_in: bool = False
    compare: str | None = None
    peers: tuple[str, ...] = ()  # see nanoserve.bench.peers.PEERS
    peer_batch_sizes: tuple[int, ...] = ()  # hf-static / hf-cb batch sizes (default: max_num_seqs)
    peer_prompts: int | None = None  # one-at-a-time peers run only this many of the requests
    roofline: bool = True  # measure the machine's rooflines (never for the stand-in)
    profile_steps: int = 0  # then profile this many steps of the same workload on a fresh engine

    def __post_init__(self) -> None:
        if self.compare is not None and self.compare not in COMPARISONS:
            raise ValueError(f"--compare must be one of {', '.join(COMPARISONS)}, got {self.compare!r}")
        if self.stand_in and self.args.model is not None:
            raise ValueError("--stand-in replaces the model; do not name one")
        if self.stand_in and self.peers:
            raise ValueError("--peers need a model; they cannot run the stand-in")

    def resolved_args(self) -> EngineArgs:
        args = self.args
        if args.max_model_len is None:
            longest = self.input_len_range[1] + self.output_len_range[1]
            args = dataclasses.replace(
                args, max_model_len=CONTIGUOUS_MAX_MODEL_LEN if self.compare == "contiguous" else longest)
        if self.compare == "contiguous" and args.num_kv_blocks is None and args.kv_cache_memory is None:
            assert args.max_model_len is not None
            blocks = CONTIGUOUS_POOL_SEQUENCES * math.ceil(args.max_model_len / args.block_size)
            args = dataclasses.replace(args, num_kv_blocks=blocks)
        return args


@dataclass(slots=True)
class ThroughputReport:
    """The runs of one invocation; with a comparison, runs[0] is compared with runs[1]."""

    config: dict[str, Any]
    runs: list[RunStats] = field(default_factory=list)
    compare: str | None = None
    num_peers: int = 0  # the last num_peers runs are peers, compared with runs[0]
    roofline: RooflineReport | None = None
    profile: str | None = None

    @property
    def ratio(self) -> float | None:
        """Batched / sequential output tok/s, or paged / contiguous peak running sequences."""
        if self.compare is None:
            return None
        a, b = self.runs
        if self.compare == "sequential":
            return a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else math.inf
        return a.peak_running / b.peak_running if b.peak_running else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "compare": self.compare, "ratio": self.ratio,
                "runs": [r.to_dict() for r in self.runs],
                "roofline": None if self.roofline is None else self.roofline.to_dict(self.runs)}

    def format(self) -> str:
        lines = [" ".join(f"{k}={v}" for k, v in self.config.items()), ""]
        headers = ["run", "requests/s", "output tok/s", "total tok/s", "steps/s", "decode tok/s",
                   "peak running", "preemptions", "elapsed s", "cpu s"]
        rows = [[r.label, f"{r.requests_per_s:.2f}", f"{r.output_tokens_per_s:.1f}",
                 f"{r.total_tokens_per_s:.1f}", f"{r.steps_per_s:.1f}", f"{r.decode_tokens_per_s:.1f}",
                 str(r.peak_running), str(r.preemptions), f"{r.elapsed_s:.2f}", f"{r.cpu_s:.2f}"]
                for r in self.runs]
        lines.append(format_table(headers, rows))
        if self.compare is not None:
            a, b = self.runs
            what = "output tok/s" if self.compare == "sequential" else "peak running sequences"
            lines += ["", f"{a.label} / {b.label} {what}: {self.ratio:.2f}x"]
        if self.num_peers:
            ours = self.runs[0]
            lines.append("")
            lines += [f"{ours.label} / {p.label} output tok/s: "
                      f"{ours.output_tokens_per_s / p.output_tokens_per_s if p.output_tokens_per_s else math.inf:.2f}x"
                      for p in self.runs[-self.num_peers:]]
        if self.roofline is not None:
            lines += ["", *self.roofline.describe(), format_table(*self.roofline.table(self.runs))]
        if self.profile is not None:
            lines += ["", self.profile]
        return "\n".join(lines)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned columns: the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def run_throughput(cfg: ThroughputConfig) -> ThroughputReport:
    """Runs the configured benchmark (and comparison) and returns its report."""
    args = cfg.resolved_args()
    make = engine_factory(args, cfg.stand_in)
    if cfg.compare == "contiguous":
        variants = [("paged", dataclasses.replace(args, kv="paged")),
                    ("contiguous", dataclasses.replace(args, kv="contiguous"))]
    else:
        variants = [("batched", args)]
    report = ThroughputReport(config={}, compare=cfg.compare)
    workload = None
    for label, variant in variants:
        engine = make(variant)
        workload = workload or Workload.random(cfg.num_prompts, cfg.input_len_range, cfg.output_len_range,
                                               engine.vocab_size, args.seed)
        if not report.config:
            report.config = _describe(cfg, engine)
        warm_up(engine, args.seed)
        report.runs.append(run_batched(engine, workload, label))
    if cfg.compare == "sequential":
        assert workload is not None
        engine = make(args)
        warm_up(engine, args.seed)
        report.runs.append(run_sequential(engine, workload))
    model = engine.model
    if cfg.peers:
        from nanoserve.bench.peers import run_peers

        assert workload is not None
        batch_sizes = cfg.peer_batch_sizes or (min(args.max_num_seqs, cfg.num_prompts),)
        peers = run_peers(cfg.peers, resolve_source(args.model), model.dtype, dict.fromkeys(batch_sizes, workload),
                          args.max_num_batched_tokens, cfg.peer_prompts)
        report.runs += peers
        report.num_peers = len(peers)
    if cfg.roofline and not cfg.stand_in:
        assert isinstance(model, CausalLM)
        roof = measure_roofline(model.dtype, model.cfg.hidden_size, device=engine.device)
        report.roofline = RooflineReport.of(roof, model.cfg, model.dtype)
    if cfg.profile_steps:
        assert workload is not None
        engine = make(args)
        warm_up(engine, args.seed)
        report.profile = profile_steps(engine, workload, cfg.profile_steps)
    return report


def _describe(cfg: ThroughputConfig, engine: LLMEngine) -> dict[str, Any]:
    a = engine.args
    return {
        "model": "stand-in" if cfg.stand_in else (a.model or "demo"),
        "num_prompts": cfg.num_prompts,
        "input_len": f"{cfg.input_len_range[0]}-{cfg.input_len_range[1]}",
        "output_len": f"{cfg.output_len_range[0]}-{cfg.output_len_range[1]}",
        "seed": a.seed,
        "max_model_len": a.max_model_len,
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "kv": "paged|contiguous" if cfg.compare == "contiguous" else a.kv,
        "kv_blocks": engine.num_blocks,
        "block_size": a.block_size,
        "prefix_caching": engine.prefix_caching,
        "torch_threads": torch.get_num_threads(),
    }
