"""`nanoserve bench serve --peer llama-server`: nanoserve and llama-server serving the same GGUF file,
driven by the same client, side by side in one run.

For each model file, every server is started once (each in its own process, on its own loopback
port, `threads` threads, room for the largest concurrency: llama-server `-np C -c C x context`,
nanoserve `--max-num-seqs C --max-model-len context`); then for each concurrency C every server
gets the same requests from `nanoserve.bench.serve` (streaming /v1/completions, token-id prompts,
greedy, `ignore_eos`, exactly the output length), one server after the other, the order reversed
at every other point (A B, B A, ...) so that a drift in the machine's load falls on both. A
server that is not being measured is idle. The servers are stopped before the next file.

Points. Concurrency C runs `num_prompts` requests (default 2 C, at least 4) of `POINTS[C]`
(prompt, output) tokens unless lengths are given. Prompt ids are drawn from the file's NORMAL
tokens (no control or padding ids), the same for every server; every point has fresh prompts.

Several nanoserve servers may run side by side, each a label with its own source tree and extra
`serve` flags (the code before and after a change, or two settings), alternated like the others.

Models: `SHAPE:FORMAT` (a `--model-shape` preset's random weights, quantized by llama.cpp:
`bench.quant.quant_files`), a catalogue name (`registry_models`), or a path to a GGUF file.
Random-weight files decode padding ids to empty text, which llama-server still streams one chunk
each: the client times every token chunk (`LoadConfig.every_chunk`).

Rooflines (`bench.roofline`, torch bf16 at `threads` threads, measured once): at each point,
memory = (1 / TPOT p50) x the bytes of the file's weights one decode step reads / bandwidth (the
single-stream ceiling), compute = (prompt + output tok/s) x 2 x those weights' parameters / the
bf16 GEMM peak (the large-batch ceiling). The table shows memory at C = 1 and compute above.

Invariant: every server process this module starts is stopped (terminated, then killed) before
`run_served` returns or raises.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from nanoserve.bench.llama_server import cpu_has_amx, llama_server_binary, server_command
from nanoserve.bench.serve import LoadConfig, run_load
from nanoserve.bench.throughput import format_table
from nanoserve.bench.workloads import Conversation

LLAMA_SERVER = "llama-server"
NANOSERVE = "nanoserve"
POINTS: dict[int, tuple[int, int]] = {1: (128, 64), 4: (256, 64), 16: (256, 64), 64: (128, 32)}
MODELS = ("qwen3-0.6b:Q8_0", "qwen3-0.6b:Q4_K_M", "llama-3.2-1b:Q8_0", "llama-3.2-1b:Q4_K_M",
          "smollm2-135m-instruct")
_CONTEXT_MARGIN = 16  # tokens of context per slot beyond the longest request
_READY_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class ServedConfig:
    """What to run. `nanoserve_trees` maps a label to a source tree whose `nanoserve serve` is run
    under that label (several: the same code measured before and after a change, alternated);
    `servers` lists the labels to run, llama-server's included."""

    models: tuple[str, ...] = MODELS
    concurrency: tuple[int, ...] = tuple(POINTS)
    num_prompts: tuple[int, ...] = ()  # one, or one per concurrency; empty: 2 C, at least 4
    lengths: tuple[int, int] | None = None  # (prompt, output) for every point instead of POINTS
    threads: int = 2
    seed: int = 0
    port: int = 18480
    nanoserve_trees: dict[str, Path] = field(default_factory=lambda: {NANOSERVE: Path(__file__).parents[2]})
    nanoserve_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)  # label -> extra `serve` flags
    servers: tuple[str, ...] = (NANOSERVE, LLAMA_SERVER)
    roofline: bool = True

    def __post_init__(self) -> None:
        unknown = [s for s in self.servers if s != LLAMA_SERVER and s not in self.nanoserve_trees]
        if unknown or not self.servers:
            raise ValueError(f"unknown server(s) {unknown}: use {LLAMA_SERVER} or a nanoserve tree's label")
        stray = sorted(set(self.nanoserve_flags) - set(self.nanoserve_trees))
        if stray:
            raise ValueError(f"--nanoserve-flags for {stray}, which name no nanoserve tree")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--max-concurrency values must be at least 1")
        missing = [c for c in self.concurrency if c not in POINTS]
        if self.lengths is None and missing:
            raise ValueError(f"concurrency {missing} has no default lengths ({sorted(POINTS)} have): give "
                             "--input-len-range and --output-len-range")
        if self.lengths is not None and min(self.lengths) < 1:
            raise ValueError("prompt and output lengths must be at least 1")
        if len(self.num_prompts) not in (0, 1, len(self.concurrency)) or any(n < 1 for n in self.num_prompts):
            raise ValueError("give one positive --num-prompts, or one per --max-concurrency")

    def point(self, concurrency: int) -> tuple[int, int, int]:
        """(requests, prompt tokens, output tokens) at `concurrency`."""
        prompt, output = self.lengths or POINTS[concurrency]
        if not self.num_prompts:
            n = max(4, 2 * concurrency)
        else:
            n = self.num_prompts[0] if len(self.num_prompts) == 1 else \
                self.num_prompts[self.concurrency.index(concurrency)]
        return n, prompt, output

    @property
    def slot_context(self) -> int:
        return max(p + o for _, p, o in map(self.point, self.concurrency)) + _CONTEXT_MARGIN


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A GGUF file and what the rooflines need of it: the parameters and bytes one decode step
    reads (every tensor but an untied input embedding) and the NORMAL token ids prompts draw on."""

    name: str
    path: Path
    params: int
    weight_bytes: int
    normal_ids: tuple[int, ...]

    @classmethod
    def read(cls, name: str, path: Path) -> ModelFile:
        import gguf

        reader = gguf.GGUFReader(path)
        untied = "output.weight" in {t.name for t in reader.tensors}
        read = [t for t in reader.tensors if not (untied and t.name == "token_embd.weight")]
        types = reader.fields["tokenizer.ggml.token_type"]
        normal = tuple(i for i, idx in enumerate(types.data)
                       if int(types.parts[idx][0]) == int(gguf.TokenType.NORMAL))
        return cls(name, path, sum(int(t.n_elements) for t in read), sum(int(t.n_bytes) for t in read), normal)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "size": self.path.stat().st_size,
                "params": self.params, "weight_bytes": self.weight_bytes}


def resolve_model(spec: str, threads: int) -> Path:
    """The GGUF file of `spec`: SHAPE:FORMAT, a catalogue name, or a path (see the module doc)."""
    from nanoserve.bench.shapes import PRESETS
    from nanoserve.model.checkpoint.registry_models import CATALOGUE, fetch

    shape, sep, fmt = spec.partition(":")
    if sep and shape in PRESETS:
        from nanoserve.bench.quant import FORMATS, quant_files
        from nanoserve.bench.shapes import shape_checkpoint

        if fmt not in FORMATS:
            raise ValueError(f"model {spec!r}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return quant_files(shape_checkpoint(shape), (fmt,), threads)[fmt]
    if spec in CATALOGUE:
        return fetch(spec)
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    raise ValueError(f"model {spec!r} is neither SHAPE:FORMAT (shapes: {', '.join(sorted(PRESETS))}), a catalogue "
                     f"model ({', '.join(CATALOGUE)}) nor an existing .gguf file")


def workload(model: ModelFile, n: int, prompt: int, output: int, seed: int) -> list[Conversation]:
    """`n` requests of `prompt` random NORMAL token ids and `output` output tokens."""
    rng = random.Random(seed)
    return [Conversation((f"{prompt} random token ids",), (output,),
                         prompt_ids=tuple(rng.choice(model.normal_ids) for _ in range(prompt))) for _ in range(n)]


@dataclass(slots=True)
class Server:
    label: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _server_argv(cfg: ServedConfig, label: str, gguf: Path, port: int,
                 binary: Path | None) -> tuple[list[str], dict[str, str], Path | None]:
    """The server's command line, environment and working directory. A nanoserve tree's server runs
    in the tree itself: `python -m` puts the working directory first on the module path, ahead of
    PYTHONPATH, so from anywhere else another checkout's nanoserve could be the one imported."""
    slots = max(cfg.concurrency)
    if label == LLAMA_SERVER:
        assert binary is not None
        argv = server_command(binary, gguf, port, slots, cfg.slot_context, cfg.threads, cpu_has_amx())
        return argv, dict(os.environ), None
    tree = cfg.nanoserve_trees[label].resolve()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", str(gguf.resolve()), "--host",
            "127.0.0.1", "--port", str(port), "--threads", str(cfg.threads), "--max-num-seqs", str(slots),
            "--max-model-len", str(cfg.slot_context), *cfg.nanoserve_flags.get(label, ())]
    return argv, env, tree


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Returns once `url`/health answers 200; RuntimeError if `process` exits first or `timeout_s`
    passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before it was healthy")
        if time.monotonic() > deadline:
            raise RuntimeError(f"was not healthy after {timeout_s:.0f} s")
        time.sleep(0.25)


def _wait_healthy(server: Server, timeout_s: float) -> None:
    try:
        wait_healthy(server.url, server.process, timeout_s)
    except RuntimeError as e:
        raise RuntimeError(f"{server.label} {e}:\n{server.log_tail()}") from None


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(30)


@contextmanager
def serving(cfg: ServedConfig, gguf: Path, binary: Path | None, log_dir: Path) -> Iterator[list[Server]]:
    """Every configured server on `gguf`, started one after the other and healthy; all stopped on exit."""
    servers: list[Server] = []
    try:
        for i, label in enumerate(cfg.servers):
            port = cfg.port + i
            argv, env, cwd = _server_argv(cfg, label, gguf, port, binary)
            log = log_dir / f"{gguf.stem}-{label}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
            servers.append(Server(label, f"http://127.0.0.1:{port}", proc, log))
            _wait_healthy(servers[-1], _READY_TIMEOUT_S)
        yield servers
    finally:
        for server in servers:
            _stop(server)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass(slots=True)
class ServedReport:
    config: ServedConfig
    machine: dict[str, Any]
    roofline: dict[str, Any] | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        cfg = {**asdict(self.config), "nanoserve_trees": {n: str(p) for n, p in self.config.nanoserve_trees.items()}}
        return {"config": cfg, "machine": self.machine, "roofline": self.roofline, "files": self.files,
                "points": self.points}

    def fractions(self, point: dict[str, Any], label: str) -> dict[str, float]:
        """The memory and compute roofline fractions of one server at one point (see the module doc)."""
        run, roof = point["runs"][label], self.roofline
        if roof is None:
            return {}
        facts = next(f for f in self.files if f["name"] == point["model"])
        tpot = run["tpot_ms"]["p50"]
        steps = 1000.0 / tpot if tpot else 0.0
        return {"memory": steps * facts["weight_bytes"] / roof["bandwidth"],
                "compute": run["total_tokens_per_s"] * 2 * facts["params"] / roof["gemm_flops"]}

    def table(self) -> str:
        labels = list(self.config.servers)
        ours = [s for s in labels if s != LLAMA_SERVER]
        peer = LLAMA_SERVER in labels
        headers = ["model", "C (prompt/output)", *[f"{s} tok/s" for s in labels],
                   *([f"{s}/{LLAMA_SERVER}" for s in ours] if peer else []),
                   *[f"{s} TTFT p50/p99 s" for s in labels], *[f"{s} TPOT p50/p99 ms" for s in labels],
                   *([f"{s} % roofline" for s in labels] if self.roofline else [])]
        rows = []
        for p in self.points:
            runs = p["runs"]
            row = [p["model"], f"{p['concurrency']} ({p['prompt_len']}/{p['output_len']})"]
            row += [f"{runs[s]['output_tokens_per_s']:.1f}" for s in labels]
            if peer:
                theirs = runs[LLAMA_SERVER]["output_tokens_per_s"]
                row += [f"{runs[s]['output_tokens_per_s'] / theirs:.2f}x" if theirs else "-" for s in ours]
            row += [f"{runs[s]['ttft_ms']['p50'] / 1000:.2f} / {runs[s]['ttft_ms']['p99'] / 1000:.2f}" for s in labels]
            row += [f"{runs[s]['tpot_ms']['p50']:.0f} / {runs[s]['tpot_ms']['p99']:.0f}" for s in labels]
            if self.roofline:
                kind = "memory" if p["concurrency"] == 1 else "compute"
                row += [f"{kind} {100 * self.fractions(p, s)[kind]:.0f}" for s in labels]
            rows.append(row)
        return format_table(headers, rows)

    def format(self) -> str:
        m = self.machine
        lines = [f"CPU: {m['cpu']} ({m['cores']} cores), {self.config.threads} threads per server; "
                 f"load average before {m['load_before']}, after {m.get('load_after', '-')}"]
        if m["amx_int8"]:
            lines.append("AMX-INT8 present: llama-server runs with --no-repack (its repacked AMX path crashes here)")
        if self.roofline:
            r = self.roofline
            lines.append(f"roofline (torch bf16, {r['threads']} threads): GEMM peak {r['gemm_flops'] / 1e9:.1f} "
                         f"GFLOP/s, memory read {r['bandwidth'] / 1e9:.1f} GB/s; % roofline: memory at C = 1 "
                         f"(1/TPOT p50 x weight bytes), compute above (tok/s x 2 x params)")
        failed = [(p["model"], p["concurrency"], s, r["failed"], r["errors"]) for p in self.points
                  for s, r in p["runs"].items() if r["failed"]]
        lines += [f"FAILED: {m} C={c} {s}: {n} requests ({'; '.join(e)})" for m, c, s, n, e in failed]
        return "\n".join([*lines, "", self.table()])

    def plot(self, path: Path) -> None:
        """Output tok/s (top) and TTFT p50 (solid) / p99 (dashed) (bottom) against concurrency, one
        column per model, one colour per server."""
        from nanoserve.bench.plots import _pyplot

        plt = _pyplot()
        models = list(dict.fromkeys(p["model"] for p in self.points))
        fig, axes = plt.subplots(2, len(models), figsize=(3.6 * len(models), 6.4), squeeze=False)
        for col, model in enumerate(models):
            points = [p for p in self.points if p["model"] == model]
            xs = [p["concurrency"] for p in points]
            top, bottom = axes[0][col], axes[1][col]
            for i, label in enumerate(self.config.servers):
                colour = f"C{i}"
                top.plot(xs, [p["runs"][label]["output_tokens_per_s"] for p in points], "o-", color=colour,
                         label=label)
                for q, style in (("p50", "o-"), ("p99", "s--")):
                    bottom.plot(xs, [p["runs"][label]["ttft_ms"][q] / 1000 for p in points], style, color=colour,
                                label=f"{label} {q}")
            for ax in (top, bottom):
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs, [str(x) for x in xs])
                ax.grid(True, which="both", alpha=0.3)
            top.set_title(model, fontsize=9)
            top.set_ylabel("output tok/s")
            bottom.set_ylabel("TTFT (s)")
            bottom.set_xlabel("concurrent streams")
        axes[0][0].legend(fontsize=7)
        axes[1][0].legend(fontsize=7)
        title = (f"nanoserve vs llama-server, same GGUF, same client; {self.machine['cpu']}, "
                 f"{self.config.threads} threads each")
        fig.suptitle("\n".join(textwrap.wrap(title, 18 * len(models) + 30)), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def machine() -> dict[str, Any]:
    from nanoserve.bench.quant import machine_info

    info = machine_info()
    return {**info, "amx_int8": "amx_int8" in info["flags"]}


def run_served(cfg: ServedConfig, log_dir: Path | None = None, progress: bool = True) -> ServedReport:
    """Runs every model and concurrency against every server (see the module doc)."""
    report = ServedReport(cfg, machine())
    binary = llama_server_binary() if LLAMA_SERVER in cfg.servers else None
    if cfg.roofline:
        import torch

        from nanoserve.bench.roofline import measure_roofline

        torch.set_num_threads(cfg.threads)
        report.roofline = measure_roofline(torch.bfloat16).to_dict()
    with tempfile.TemporaryDirectory(prefix="nanoserve-served-") as tmp:
        logs = log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for spec in cfg.models:
            model = ModelFile.read(spec, resolve_model(spec, cfg.threads))
            report.files.append(model.to_dict())
            with serving(cfg, model.path, binary, logs) as servers:
                for k, conc in enumerate(cfg.concurrency):
                    n, prompt, output = cfg.point(conc)
                    convs = workload(model, n, prompt, output, cfg.seed + 1000 * k)
                    point: dict[str, Any] = {"model": spec, "concurrency": conc, "num_prompts": n, "prompt_len": prompt,
                                             "output_len": output, "load_before": _load(), "runs": {}}
                    for server in (servers if k % 2 == 0 else servers[::-1]):
                        load = LoadConfig(server.url, server.label, max_concurrency=conc, seed=cfg.seed,
                                          every_chunk=True)
                        summary = asyncio.run(run_load(load, convs, lambda text: 0)).summary()
                        point["runs"][server.label] = summary
                        if progress:
                            print(f"{spec} C={conc} {server.label}: {summary['output_tokens_per_s']:.1f} output tok/s, "
                                  f"TTFT p50 {summary['ttft_ms']['p50'] / 1000:.2f} s p99 "
                                  f"{summary['ttft_ms']['p99'] / 1000:.2f} s ({summary['failed']} failed; load "
                                  f"{_load()})", flush=True)
                    point["load_after"] = _load()
                    report.points.append(point)
    report.machine["load_after"] = _load()
    return report
