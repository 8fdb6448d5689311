"""The machine's rooflines, measured with torch in the run's dtype and thread count, and the
fraction of each that a run reached.

- GEMM peak (FLOP/s): the best of two `F.linear` products (nn.Linear's [out, in] weight layout,
  the one the model uses), [1024, 1024] x [1024, 1024] and one shaped like batched decode,
  [64, hidden] x [hidden, 3 x hidden], in the dtype. For a dtype other than fp32 the fp32 peak is
  measured too: on a CPU without native bf16 (AVX2) torch's bf16 GEMM is several times slower than
  its fp32 one, while a kernel that widens bf16 to fp32 on the fly (llama.cpp's) can approach the
  fp32 peak, so that is the hardware's ceiling for bf16 weights there.
- Memory bandwidth (bytes/s): the faster of two reads of 256 MiB of fp32 (well past the caches):
  `sum`, and `F.linear` of one row against it (a mat-vec streams its matrix; with one thread it
  reads faster than `sum`, whose adds then limit it).
- Mat-vec bandwidth (bytes/s): `F.linear` of one row against a 64 MiB weight in the dtype, bytes
  of the weight per second: what torch's own kernel reaches on the single-stream decode pattern.

Batch-1 decode reads every weight once per token, so tokens/s x weight bytes <= bandwidth;
large-batch decode does 2 x params FLOPs per token, so tokens/s x 2 x params <= peak FLOP/s.
`RunStats` rows report both fractions for their decode steps (bytes once per step, whatever
the batch) and the compute fraction of their prefill. With long contexts and many sequences a
decode step also reads every running sequence's K and V, which can outweigh the weights (a GPU at
batch 256): where a run counts the positions its decode steps attended, the bandwidth fraction
is also given with those bytes (every layer's K and V for every position: an upper bound for
models with sliding-window layers).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from nanoserve.model.config import ModelConfig

_BANDWIDTH_BYTES = 256 << 20
_MATVEC_BYTES = 64 << 20
_CPU = torch.device("cpu")


def _best_seconds(fn: Callable[[], object], min_time: float = 0.3, max_reps: int = 50,
                  device: torch.device = _CPU) -> float:
    """Fastest of repeated calls (after one warm-up), repeated until `min_time` has passed; on
    CUDA each call is timed to its completion."""
    def timed() -> object:
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    timed()
    best, spent, reps = float("inf"), 0.0, 0
    while (spent < min_time or reps < 3) and reps < max_reps:
        start = time.perf_counter()
        timed()
        seconds = time.perf_counter() - start
        best, spent, reps = min(best, seconds), spent + seconds, reps + 1
    return best


@dataclass(frozen=True, slots=True)
class Roofline:
    """Measured ceilings of this machine for `dtype` at `threads` torch threads."""

    dtype: str
    threads: int
    gemm_flops: float  # FLOP/s, best GEMM in dtype
    bandwidth: float  # bytes/s, best streaming read
    matvec_bandwidth: float  # bytes/s of weight through F.linear with one row
    fp32_gemm_flops: float  # FLOP/s, best GEMM in fp32 (the same as gemm_flops for fp32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        fp32 = "" if self.dtype == "float32" else f" (fp32: {self.fp32_gemm_flops / 1e9:.1f})"
        return (f"roofline ({self.dtype}, {self.threads} threads): GEMM peak {self.gemm_flops / 1e9:.1f} GFLOP/s"
                f"{fp32}, memory read {self.bandwidth / 1e9:.1f} GB/s, torch mat-vec "
                f"{self.matvec_bandwidth / 1e9:.1f} GB/s")


def gemm_peak(dtype: torch.dtype, hidden: int, min_time: float, device: torch.device = _CPU) -> float:
    """Best FLOP/s of `F.linear` in `dtype`: [1024, 1024] x [1024, 1024], [64, hidden] x
    [hidden, 3 hidden], and on CUDA also [8192, 8192] x [8192, 8192] (a GPU needs large tiles)."""
    shapes = [(1024, 1024, 1024), (64, hidden, 3 * hidden)] + ([(8192, 8192, 8192)] if device.type == "cuda" else [])
    best = 0.0
    for m, k, n in shapes:
        x, w = torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype)
        best = max(best, 2 * m * k * n / _best_seconds(functools.partial(F.linear, x, w), min_time, device=device))
    return best


@torch.inference_mode()
def measure_roofline(dtype: torch.dtype, hidden: int = 1024, min_time: float = 0.3,
                     device: torch.device = _CPU) -> Roofline:
    """Measures, on `device`, the GEMM peak in `dtype` (and in fp32), the streaming read bandwidth
    and torch's mat-vec bandwidth in `dtype`."""
    peak = gemm_peak(dtype, hidden, min_time, device)
    fp32_peak = peak if dtype == torch.float32 else gemm_peak(torch.float32, hidden, min_time, device)
    buf = torch.ones(_BANDWIDTH_BYTES // 4, device=device)
    row = torch.ones(1, 4096, device=device)
    read = min(_best_seconds(buf.sum, min_time, device=device),
               _best_seconds(lambda: F.linear(row, buf.view(-1, 4096)), min_time, device=device))
    bandwidth = _BANDWIDTH_BYTES / read
    elem = torch.empty((), dtype=dtype).element_size()
    rows = _MATVEC_BYTES // elem // 4096
    mat = torch.randn(rows, 4096, device=device).to(dtype)
    vec = torch.randn(1, 4096, device=device).to(dtype)
    matvec = _MATVEC_BYTES / _best_seconds(lambda: F.linear(vec, mat), min_time, device=device)
    return Roofline(str(dtype).removeprefix("torch."), torch.get_num_threads(), peak, bandwidth, matvec, fp32_peak)


def decode_params(cfg: ModelConfig) -> int:
    """Parameters a decode step reads and multiplies: all of them, less an untied input embedding
    (only one row of it is read per token; the LM head is read whole)."""
    return cfg.num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


@dataclass(frozen=True, slots=True)
class RooflineFractions:
    """One run's position under the rooflines. Bandwidth: decode steps/s x weight bytes (a step
    reads every weight once; at batch 1 this is decode tok/s x weight bytes), and with the K/V bytes
    of the positions attended added (0 when the run did not count them). Compute: tok/s x 2 x
    params, for decode and for prefill."""

    decode_bandwidth: float
    decode_compute: float
    prefill_compute: float
    decode_compute_fp32: float  # decode against the fp32 GEMM peak (see the module docstring)
    decode_bandwidth_kv: float = 0.0


def fractions(roof: Roofline, params: int, weight_bytes: int, decode_steps_per_s: float,
              decode_tokens_per_s: float, prefill_tokens_per_s: float, decode_context_tokens_per_s: float = 0.0,
              kv_bytes_per_token: int = 0) -> RooflineFractions:
    weights = decode_steps_per_s * weight_bytes
    kv = decode_context_tokens_per_s * kv_bytes_per_token
    return RooflineFractions(weights / roof.bandwidth,
                             decode_tokens_per_s * 2 * params / roof.gemm_flops,
                             prefill_tokens_per_s * 2 * params / roof.gemm_flops,
                             decode_tokens_per_s * 2 * params / roof.fp32_gemm_flops,
                             (weights + kv) / roof.bandwidth if kv else 0.0)


class DecodeRates(Protocol):
    """What the roofline table reads from a run (`nanoserve.bench.throughput.RunStats`)."""

    label: str

    @property
    def decode_steps_per_s(self) -> float: ...

    @property
    def decode_tokens_per_s(self) -> float: ...

    @property
    def decode_context_tokens_per_s(self) -> float: ...

    @property
    def decode_batch(self) -> float: ...

    @property
    def prefill_tokens_per_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class RooflineReport:
    """The rooflines plus the model's decode parameters and their bytes in the run's dtype, and
    the bytes of one position's K and V over all layers (the KV pool holds the model's dtype)."""

    roofline: Roofline
    params: int
    weight_bytes: int
    kv_bytes_per_token: int = 0

    @classmethod
    def of(cls, roofline: Roofline, cfg: ModelConfig, dtype: torch.dtype) -> RooflineReport:
        params = decode_params(cfg)
        size = torch.empty((), dtype=dtype).element_size()
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * size
        return cls(roofline, params, params * size, kv)

    def fractions(self, run: DecodeRates) -> RooflineFractions:
        return fractions(self.roofline, self.params, self.weight_bytes, run.decode_steps_per_s,
                         run.decode_tokens_per_s, run.prefill_tokens_per_s, run.decode_context_tokens_per_s,
                         self.kv_bytes_per_token)

    def describe(self) -> list[str]:
        return [self.roofline.describe(), f"weights read per decode step: {self.params / 1e6:.1f}M params, "
                f"{self.weight_bytes / 1e9:.3f} GB; K and V per position attended: {self.kv_bytes_per_token:,} bytes"]

    def table(self, runs: Sequence[DecodeRates]) -> tuple[list[str], list[list[str]]]:
        """Headers and rows: prefill and decode rates and the fraction of each roofline."""
        fp32 = self.roofline.dtype != "float32"
        headers = ["run", "prefill tok/s", "decode tok/s", "decode batch", "decode % bandwidth",
                   "decode % bandwidth, KV incl.", "decode % GEMM peak", *(["decode % fp32 peak"] if fp32 else []),
                   "prefill % GEMM peak"]
        rows = []
        for r in runs:
            f = self.fractions(r)
            rows.append([r.label, _rate(r.prefill_tokens_per_s), _rate(r.decode_tokens_per_s),
                         _rate(r.decode_batch), _pct(f.decode_bandwidth), _pct(f.decode_bandwidth_kv),
                         _pct(f.decode_compute),
                         *([_pct(f.decode_compute_fp32)] if fp32 else []), _pct(f.prefill_compute)])
        return headers, rows

    def serving_table(self, runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
        """Headers and rows for load-test summaries (`bench serve`): the tokens the server computed
        per second (prompt tokens not served from the prefix cache, and output) against the GEMM
        peak; 1 / median TPOT, one decode step of a stream per weight read, against the bandwidth."""
        headers = ["run", "computed tok/s", "% GEMM peak", "1/TPOT p50 (steps/s)", "% bandwidth"]
        rows = []
        for r in runs:
            computed = r["total_tokens_per_s"] - r.get("cached_tokens", 0) / (r["duration_s"] or math.inf)
            tpot = r.get("tpot_ms", {}).get("p50", 0.0)
            steps = 1000.0 / tpot if tpot else 0.0
            point = f" c={r['max_concurrency'] or '-'} r={r['request_rate']:g}" if "peer" not in r else ""
            name = r["label"] + point
            rows.append([name, _rate(computed), _pct(computed * 2 * self.params / self.roofline.gemm_flops),
                         _rate(steps), _pct(steps * self.weight_bytes / self.roofline.bandwidth)])
        return headers, rows

    def to_dict(self, runs: Sequence[DecodeRates]) -> dict[str, Any]:
        return {**self.roofline.to_dict(), "decode_params": self.params, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "runs": {r.label: asdict(self.fractions(r)) for r in runs}}


def _rate(x: float) -> str:
    return f"{x:.1f}" if x else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}" if x else "-"
