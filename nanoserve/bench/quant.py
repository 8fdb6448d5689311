"""`nanoserve bench quant`: nanoserve against llama.cpp on the same GGUF files, BF16, Q8_0 and Q4_K_M
by default, or any of FORMATS (llama.cpp's file types of the block formats nanoserve multiplies).

Files. For each `--model-shape` preset: its random-weight folder (`nanoserve.bench.shapes`), a BF16
GGUF written from it (`gguf_export`, through `peers.gguf_for`), and the Q8_0, Q4_K_M, ... GGUFs made
from that BF16 file by llama.cpp's own quantizer (`llama_model_quantize`, which mixes types as its
file type says: the LM head of a Q4_1 file is Q6_K), so both engines read the very same bytes. All
are cached under the nanoserve cache dir. Without llama-cpp-python the Q8_0 file is `gguf_export`'s
and there are no others.

Runs. For each file and engine, one freshly spawned process (so that its resident memory is its
own) loads the file once and measures, greedy with EOS ignored:
- single-stream decode tok/s: one request of `prompt_len` tokens and `single_tokens` output tokens,
  `repeats` times (fresh prompts each time; the median is reported with the range);
- batch-B decode tok/s for each B of `batch_sizes`: B such requests at once, `batch_tokens` output
  tokens each; only the steps in which every sequence decodes are timed;
- resident memory from /proc/self/status (Linux): before loading (the interpreter, torch and the
  engine's library), after loading and one warm-up, and the peak (VmHWM) of the whole process.
  nanoserve's KV pool and llama.cpp's contexts hold the largest batch's tokens (`kv_blocks`), 2 bytes
  a value in both, so resident memory less the baseline is compared with file size + that KV.

The roofline fraction of a single-stream run is decode tok/s x the bytes of the file's weights
that one decode step reads (every tensor but an untied input embedding, of which a step reads one
row) / the machine's memory read bandwidth (`roofline.measure_roofline`, measured once, before the
children). It is the file's ceiling: an engine that dequantizes a Q4_K_M file to bf16 moves about
3.5x those bytes per token and shows a fraction to match.

Invariants: both engines of a file get the same prompts; a child loads exactly one file; the parent
never loads a model (its memory does not matter, the children's does).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoserve.bench.peers import gguf_for
from nanoserve.bench.roofline import Roofline, measure_roofline
from nanoserve.bench.run_stats import RunStats
from nanoserve.bench.shapes import shape_checkpoint
from nanoserve.bench.throughput import format_table
from nanoserve.bench.workloads import Workload
from nanoserve.kv.manager import blocks_needed
from nanoserve.model.config import ModelConfig

FORMATS = ("BF16", "Q8_0", "Q4_K_M", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K")
DEFAULT_FORMATS = FORMATS[:3]
ENGINES = ("nanoserve", "llama.cpp")
DEFAULT_SHAPES = ("qwen3-0.6b", "llama-3.2-1b")
BLOCK_SIZE = 16
_KV_ELEMENT_BYTES = 2  # nanoserve's bf16 pool and llama.cpp's default f16 cache
_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass(frozen=True, slots=True)
class QuantBenchConfig:
    """What to run. `engine_options` are extra EngineArgs fields for nanoserve (e.g. a
    quantization mode); `overrides` replace config fields of every shape (for quick checks)."""

    shapes: tuple[str, ...] = DEFAULT_SHAPES
    formats: tuple[str, ...] = DEFAULT_FORMATS
    engines: tuple[str, ...] = ENGINES
    prompt_len: int = 16
    single_tokens: int = 64
    batch_tokens: int = 16
    batch_sizes: tuple[int, ...] = (16, 64)
    repeats: int = 1
    threads: int = 2
    seed: int = 0
    dtype: str = "bfloat16"
    overrides: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)
    roofline: bool = True
    # llama.cpp's use_extra_bufts (AMX and CPU_REPACK weight layouts). None: off on a CPU with
    # AMX-INT8, where llama.cpp's AMX product segfaults on quantized files (llama.cpp #20824), else on.
    llama_cpp_extra_buffers: bool | None = None

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS] + [e for e in self.engines if e not in ENGINES]
        if unknown:
            raise ValueError(f"unknown format(s) or engine(s) {unknown}; formats: {FORMATS}, engines: {ENGINES}")
        if min(self.prompt_len, self.single_tokens, self.batch_tokens, self.repeats, self.threads) < 1:
            raise ValueError("prompt length, token counts, repeats and threads must be at least 1")
        if self.single_tokens < 2 or self.batch_tokens < 2:
            raise ValueError("a decode rate needs at least 2 output tokens (the first comes from prefill)")
        if any(b < 2 for b in self.batch_sizes):
            raise ValueError("batch sizes must be at least 2 (batch 1 is the single-stream run)")
        needs_llama = "llama.cpp" in self.engines or bool(set(self.formats) - {"BF16", "Q8_0"})
        if needs_llama and not llama_cpp_available():
            raise ValueError("llama.cpp and files other than BF16 and Q8_0 need llama-cpp-python (pip install -c "
                             "constraints.txt llama-cpp-python); or run --engines nanoserve --formats bf16 q8_0")

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + max(self.single_tokens, self.batch_tokens)

    @property
    def kv_blocks(self) -> int:
        """KV blocks of BLOCK_SIZE tokens the largest run holds at once: nanoserve's pool, and what
        llama.cpp's context for the largest batch holds (within a block per sequence)."""
        return max([blocks_needed(self.prompt_len + self.single_tokens, BLOCK_SIZE)]
                   + [b * blocks_needed(self.prompt_len + self.batch_tokens, BLOCK_SIZE) for b in self.batch_sizes])


# --- the files --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One GGUF file: its size, the bytes a decode step reads and its tensor types."""

    shape: str
    format: str
    path: str
    file_bytes: int
    weight_bytes: int
    tensor_types: dict[str, int]  # GGML type name -> number of tensors

    @classmethod
    def of(cls, shape: str, fmt: str, path: Path) -> FileInfo:
        import gguf

        tensors = gguf.GGUFReader(path).tensors
        names = {t.name for t in tensors}
        untied_embedding = "output.weight" in names
        read = sum(int(t.n_bytes) for t in tensors if not (untied_embedding and t.name == "token_embd.weight"))
        types = Counter(t.tensor_type.name for t in tensors)
        return cls(shape, fmt, str(path), path.stat().st_size, read, dict(sorted(types.items())))


def quantize_with_llama_cpp(src: Path, out: Path, fmt: str, threads: int) -> Path:
    """`src` (a BF16 or F32 GGUF) quantized by llama.cpp to `fmt` (one of FORMATS but BF16) at `out`,
    written under a temporary name and renamed into place."""
    import logging

    import llama_cpp as lc

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{fmt}"), threads
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    if lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {src.name} to {fmt}")
    os.replace(tmp, out)
    return out


def quant_files(model_dir: Path, formats: tuple[str, ...], threads: int) -> dict[str, Path]:
    """The GGUF of `model_dir` in each format, made once and cached beside the BF16 export:
    quantized by llama.cpp from the BF16 file where llama-cpp-python is installed, else (Q8_0 only)
    written by `gguf_export`."""
    bf16 = gguf_for(model_dir, "BF16")
    files: dict[str, Path] = {}
    for fmt in formats:
        if fmt == "BF16":
            files[fmt] = bf16
        elif llama_cpp_available():
            out = bf16.with_name(f"{bf16.stem}-llama.cpp-{fmt}.gguf")
            files[fmt] = out if out.exists() else quantize_with_llama_cpp(bf16, out, fmt, threads)
        elif fmt == "Q8_0":
            files[fmt] = gguf_for(model_dir, "Q8_0")
        else:
            raise ValueError(f"{fmt} needs llama.cpp's quantizer (llama-cpp-python)")
    return files


# --- one child process: one engine on one file -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """Everything a child needs (picklable). `singles`: one single-request workload per repeat;
    `batches`: one workload per batch size."""

    engine: str
    gguf: str
    singles: tuple[Workload, ...]
    batches: tuple[Workload, ...]
    threads: int
    seed: int
    dtype: str
    max_model_len: int
    kv_blocks: int  # nanoserve's pool
    engine_options: tuple[tuple[str, Any], ...]
    extra_buffers: bool  # llama.cpp's use_extra_bufts


@dataclass(frozen=True, slots=True)
class Memory:
    """Resident bytes of a child: `baseline` before loading; `loaded` after loading and the
    (first) single-stream run, the model still held (nanoserve's KV pool, sized for the largest
    batch, is allocated by then; llama.cpp's context holds one sequence); `peak` the high-water
    mark of the whole process; `anon` and `file` split `loaded` into anonymous memory and mapped
    file pages (llama.cpp maps the GGUF: its pages count once read)."""

    baseline: int
    loaded: int
    peak: int
    anon: int
    file: int


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine on one file: each single-stream repeat's and each batch's RunStats (as dicts)."""

    engine: str
    singles: tuple[dict[str, Any], ...]
    batches: dict[int, dict[str, Any]]
    memory: Memory
    load_s: float

    @property
    def single_rates(self) -> list[float]:
        return [s["decode_tokens_per_s"] for s in self.singles]

    @property
    def single_rate(self) -> float:
        return statistics.median(self.single_rates)

    def rate(self, batch: int) -> float:
        """Decode tok/s at `batch` (1: the single-stream median); 0 where not run."""
        if batch == 1:
            return self.single_rate
        return float(self.batches[batch]["decode_tokens_per_s"]) if batch in self.batches else 0.0


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes (Linux's /proc/self/status)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_KEYS:
            out[key] = int(value.split()[0]) * 1024
    return out


def _memory(baseline: dict[str, int], loaded: dict[str, int]) -> Memory:
    return Memory(baseline["VmRSS"], loaded["VmRSS"], proc_status()["VmHWM"], loaded["RssAnon"], loaded["RssFile"])


def _run_nanoserve(job: Job) -> EngineResult:
    from nanoserve.bench.throughput import run_batched, warm_up
    from nanoserve.engine.args import EngineArgs
    from nanoserve.runtime.builder import build_engine

    baseline = proc_status()
    start = time.perf_counter()
    largest = max([1] + [len(w.prompts) for w in job.batches])
    args = EngineArgs(model=job.gguf, dtype=job.dtype, max_model_len=job.max_model_len, max_num_seqs=largest,
                      num_kv_blocks=job.kv_blocks, block_size=BLOCK_SIZE, seed=job.seed, **dict(job.engine_options))
    engine = build_engine(args)
    warm_up(engine, job.seed)
    load_s = time.perf_counter() - start
    singles = tuple(run_batched(engine, w, "nanoserve-1").to_dict() for w in job.singles)
    loaded = proc_status()
    batches = {len(w.prompts): run_batched(engine, w, f"nanoserve-{len(w.prompts)}").to_dict() for w in job.batches}
    return EngineResult("nanoserve", singles, batches, _memory(baseline, loaded), load_s)


def _run_llama_cpp(job: Job) -> EngineResult:
    from nanoserve.bench.peers import run_llama_cpp_batched

    baseline = proc_status()
    marks: list[tuple[float, dict[str, int]]] = []
    gguf, start = Path(job.gguf), time.perf_counter()

    def run(w: Workload, on_finished: Callable[[], object] | None = None) -> RunStats:
        return run_llama_cpp_batched(gguf, w, len(w.prompts), job.threads, f"llama.cpp-{len(w.prompts)}",
                                     job.extra_buffers, on_finished)

    first = run(job.singles[0], lambda: marks.append((time.perf_counter(), proc_status())))
    singles = [first] + [run(w) for w in job.singles[1:]]
    batches = {len(w.prompts): run(w).to_dict() for w in job.batches}
    load_s = marks[0][0] - start - first.elapsed_s
    return EngineResult("llama.cpp", tuple(s.to_dict() for s in singles), batches, _memory(baseline, marks[0][1]),
                        load_s)


def run_job(job: Job) -> EngineResult:
    """Runs `job` in this process (meant to be a fresh child: see `run_isolated`)."""
    torch.set_num_threads(job.threads)
    return _run_nanoserve(job) if job.engine == "nanoserve" else _run_llama_cpp(job)


def run_isolated(job: Job) -> EngineResult:
    """`run_job` in a freshly spawned process, so that its resident memory is its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_job, job).result()


# --- the whole run ------------------------------------------------------------------------------------------


def bandwidth_fraction(tokens_per_s: float, weight_bytes: int, roof: Roofline) -> float:
    """Single-stream decode against the memory roofline: bytes moved per second over bandwidth."""
    return tokens_per_s * weight_bytes / roof.bandwidth if roof.bandwidth > 0 else math.nan


@dataclass(slots=True)
class FileResult:
    """A file and each engine's result on it."""

    info: FileInfo
    kv_bytes: int
    results: dict[str, EngineResult] = field(default_factory=dict)

    def to_dict(self, roof: Roofline | None) -> dict[str, Any]:
        out: dict[str, Any] = {**dataclasses.asdict(self.info), "kv_bytes": self.kv_bytes, "engines": {}}
        for name, r in self.results.items():
            fraction = None if roof is None else bandwidth_fraction(r.single_rate, self.info.weight_bytes, roof)
            out["engines"][name] = {**dataclasses.asdict(r), "single_decode_tokens_per_s": r.single_rate,
                                    "single_bandwidth_fraction": fraction}
        return out


@dataclass(slots=True)
class QuantReport:
    """Every file's results, the machine and, unless disabled, the rooflines."""

    config: QuantBenchConfig
    machine: dict[str, Any]
    files: list[FileResult] = field(default_factory=list)
    roofline: Roofline | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config), "machine": self.machine,
                "roofline": None if self.roofline is None else self.roofline.to_dict(),
                "files": [f.to_dict(self.roofline) for f in self.files]}

    def rate_table(self) -> tuple[list[str], list[list[str]]]:
        """Decode tok/s per file: single stream (median and range over repeats, % of the bandwidth
        roofline) and each batch size, with nanoserve / llama.cpp ratios."""
        headers = ["shape", "file", "MB", "1-stream ns", "1-stream l.cpp", "ratio", "% BW ns", "% BW l.cpp"]
        for b in self.config.batch_sizes:
            headers += [f"b{b} ns", f"b{b} l.cpp", "ratio"]
        rows = []
        for f in self.files:
            ns, lc = f.results.get("nanoserve"), f.results.get("llama.cpp")
            row = [f.info.shape, f.info.format, f"{f.info.file_bytes / 1e6:.0f}", _single(ns), _single(lc),
                   _ratio(_rate(ns, 1), _rate(lc, 1)), self._bandwidth(f, ns), self._bandwidth(f, lc)]
            for b in self.config.batch_sizes:
                row += [_num(_rate(ns, b)), _num(_rate(lc, b)), _ratio(_rate(ns, b), _rate(lc, b))]
            rows.append(row)
        return headers, rows

    def memory_table(self) -> tuple[list[str], list[list[str]]]:
        """Resident MB per file and engine: baseline, after loading and the single-stream run (of
        which mapped file pages), peak; each of the last two less the baseline over file size + KV."""
        headers = ["shape", "file", "engine", "file+KV MB", "baseline", "loaded", "of which file", "peak",
                   "(loaded-base)/(file+KV)", "(peak-base)/(file+KV)", "load s"]
        rows = []
        for f in self.files:
            need = f.info.file_bytes + f.kv_bytes
            for name, r in f.results.items():
                m = r.memory
                rows.append([f.info.shape, f.info.format, name, f"{need / 1e6:.0f}", f"{m.baseline / 1e6:.0f}",
                             f"{m.loaded / 1e6:.0f}", f"{m.file / 1e6:.0f}", f"{m.peak / 1e6:.0f}",
                             f"{(m.loaded - m.baseline) / need:.2f}", f"{(m.peak - m.baseline) / need:.2f}",
                             f"{r.load_s:.1f}"])
        return headers, rows

    def quantized_vs_bf16(self) -> list[str]:
        """nanoserve's decode rate on each quantized file over its rate on the same shape's BF16
        file, single stream and at each batch size."""
        lines = []
        bf16 = {f.info.shape: f.results.get("nanoserve") for f in self.files if f.info.format == "BF16"}
        for f in self.files:
            ours, base = f.results.get("nanoserve"), bf16.get(f.info.shape)
            if f.info.format == "BF16" or ours is None or base is None:
                continue
            parts = [f"{'1-stream' if b == 1 else f'b{b}'} {_ratio(ours.rate(b), base.rate(b))}"
                     for b in (1, *self.config.batch_sizes)]
            lines.append(f"nanoserve {f.info.shape} {f.info.format} / BF16 decode tok/s: {', '.join(parts)}")
        return lines

    def format(self) -> str:
        c = self.config
        lines = [f"cpu: {self.machine['cpu']} ({self.machine['cores']} cores), threads={c.threads}, "
                 f"load average {self.machine['load_before']} -> {self.machine['load_after']}",
                 f"prompt {c.prompt_len} tokens; single stream {c.single_tokens} output tokens x {c.repeats}; "
                 f"batches {list(c.batch_sizes)} x {c.batch_tokens} output tokens; greedy, EOS ignored"]
        if c.engine_options:
            lines.append(f"nanoserve engine options: {c.engine_options}")
        if "llama.cpp" in c.engines:
            lines.append(f"llama.cpp: use_extra_bufts={self.machine['llama_cpp_extra_buffers']} (AMX and repacked "
                         f"weights), one llama_decode per step, KV f16")
        if self.roofline is not None:
            lines.append(self.roofline.describe())
        lines += ["", "decode tok/s (ns: nanoserve; ratio: nanoserve / llama.cpp; % BW: single stream x weight "
                      "bytes per token / memory read bandwidth)", format_table(*self.rate_table()),
                  "", "resident memory, MB (baseline: interpreter, torch and the engine's library, before loading)",
                  format_table(*self.memory_table())]
        quantized = self.quantized_vs_bf16()
        if quantized:
            lines += ["", *quantized]
        lines += ["", "files:"] + [f"  {f.info.shape} {f.info.format}: {f.info.path} "
                                   f"({', '.join(f'{k} x{v}' for k, v in f.info.tensor_types.items())}; "
                                   f"{f.info.weight_bytes / 1e6:.0f} MB read per decode step)" for f in self.files]
        return "\n".join(lines)

    def _bandwidth(self, f: FileResult, r: EngineResult | None) -> str:
        if r is None or self.roofline is None:
            return "-"
        return f"{100 * bandwidth_fraction(r.single_rate, f.info.weight_bytes, self.roofline):.1f}"

    def plot(self, out_dir: Path) -> list[Path]:
        """One PNG per shape: decode tok/s against batch size, a line per engine and format."""
        from nanoserve.bench.plots import plot_throughput

        paths = []
        for shape in self.config.shapes:
            runs, peers = [], []
            for f in (f for f in self.files if f.info.shape == shape):
                for name, r in f.results.items():
                    points = [(b, r.rate(b)) for b in (1, *self.config.batch_sizes)]
                    label = f"{name} {f.info.format}"
                    if name == "nanoserve":
                        runs += [{"label": label, "max_concurrency": b, "output_tokens_per_s": v} for b, v in points]
                    else:
                        peers += [{"peer": label, "batch": b, "output_tokens_per_s": v} for b, v in points]
            path = out_dir / f"quant-{shape}.png"
            plot_throughput(runs, peers, path, f"{shape} shape (random weights): decode tok/s, nanoserve vs "
                                               f"llama.cpp on the same GGUF files, {self.config.threads} thread(s), "
                                               f"{self.machine['cpu']}")
            paths.append(path)
        return paths


def _single(r: EngineResult | None) -> str:
    if r is None:
        return "-"
    rates = r.single_rates
    spread = f" ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else ""
    return f"{r.single_rate:.1f}{spread}"


def _rate(r: EngineResult | None, batch: int) -> float:
    return 0.0 if r is None else r.rate(batch)


def _num(x: float) -> str:
    return f"{x:.1f}" if x else "-"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def machine_info() -> dict[str, Any]:
    """The CPU's model name and the flags that decide which kernels run, core count, load."""
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            break
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return {"cpu": model, "flags": [f for f in wanted if f in flags], "cores": os.cpu_count(),
            "load_before": _load(), "torch": torch.__version__}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _workloads(cfg: QuantBenchConfig, vocab: int) -> tuple[tuple[Workload, ...], tuple[Workload, ...]]:
    """Single-request workloads (one per repeat, each with its own prompt) and one per batch size."""
    p, seed = (cfg.prompt_len, cfg.prompt_len), cfg.seed
    singles = tuple(Workload.random(1, p, (cfg.single_tokens,) * 2, vocab, seed + 1000 + i) for i in range(cfg.repeats))
    batches = tuple(Workload.random(b, p, (cfg.batch_tokens,) * 2, vocab, seed + b) for b in cfg.batch_sizes)
    return singles, batches


def _prompt_vocab(model_dir: Path, cfg: ModelConfig) -> int:
    """Prompt ids stay below both the model's and the tokenizer's vocabulary."""
    import tokenizers

    return min(cfg.vocab_size, tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size())


def run_quant_bench(cfg: QuantBenchConfig, progress: bool = True) -> QuantReport:
    """Builds (or finds) every file, measures the rooflines, then runs each engine on each file in
    its own process."""
    report = QuantReport(cfg, machine_info())
    extra_buffers = cfg.llama_cpp_extra_buffers
    if extra_buffers is None:
        extra_buffers = "amx_int8" not in report.machine["flags"]
    report.machine["llama_cpp_extra_buffers"] = extra_buffers
    torch.set_num_threads(cfg.threads)
    for shape in cfg.shapes:
        model_dir = shape_checkpoint(shape, cfg.overrides)
        model_cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
        singles, batches = _workloads(cfg, _prompt_vocab(model_dir, model_cfg))
        per_token = 2 * model_cfg.num_hidden_layers * model_cfg.num_key_value_heads * model_cfg.head_dim
        kv_bytes = per_token * _KV_ELEMENT_BYTES * cfg.kv_blocks * BLOCK_SIZE
        if report.roofline is None and cfg.roofline:
            report.roofline = measure_roofline(torch.bfloat16, model_cfg.hidden_size)
        for fmt, path in quant_files(model_dir, cfg.formats, cfg.threads).items():
            result = FileResult(FileInfo.of(shape, fmt, path), kv_bytes)
            for engine in cfg.engines:
                job = Job(engine, str(path), singles, batches, cfg.threads, cfg.seed, cfg.dtype, cfg.max_model_len,
                          cfg.kv_blocks, tuple(sorted(cfg.engine_options.items())), extra_buffers)
                result.results[engine] = run_isolated(job)
                if progress:
                    r = result.results[engine]
                    rates = ", ".join(f"{'1-stream' if b == 1 else f'b{b}'} {r.rate(b):.1f} tok/s"
                                      for b in (1, *cfg.batch_sizes))
                    print(f"{shape} {fmt} {engine}: {rates}, peak RSS {r.memory.peak / 1e6:.0f} MB", flush=True)
            report.files.append(result)
    report.machine["load_after"] = _load()
    return report
