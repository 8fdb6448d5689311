"""Peers run on the same weights and the same requests as nanoserve, in the same process.

- `hf-sequential`: Hugging Face `transformers`, one request at a time with `generate`.
- `hf-static`: `generate` over static batches of `batch_size` requests, left-padded to the
  longest prompt; a batch runs until its longest request is done (`generate` has one length per
  batch), so only each request's own output tokens are counted as output.
- `hf-cb`: transformers' own continuous batching (the manager behind `generate_batch`), each
  request with its own `max_new_tokens`, at most `batch_size` requests per batch.
- `llama.cpp` / `llama.cpp-q8_0`: `llama-cpp-python` on a GGUF written from the same folder by
  `nanoserve.model.checkpoint.gguf_export` (in the run's dtype, or Q8_0), one request at a time.
- `llama.cpp-batch`: llama.cpp's own batching through its C API (what llama-server's parallel
  slots do): up to `batch_size` sequences share each `llama_decode`, a finished one's slot is
  cleared and refilled at once, new prompts join the batch up to 2048 tokens per call.

Every request is greedy and yields exactly its output length (EOS suppressed). What is timed, per
run: the whole workload (output tok/s), prefill (the forward over the prompt up to the first token)
and decode (every later step); per request, the time from being handed to the peer to its first
and last token. Rows of a static batch that are already past their length still cost decode time
but are not counted as output; decode tok/s counts every row the step computed (the hardware rate).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nanoserve.bench.run_stats import RunStats
from nanoserve.bench.workloads import Workload
from nanoserve.cache import cache_root

PEERS = ("hf-sequential", "hf-static", "hf-cb", "llama.cpp", "llama.cpp-q8_0", "llama.cpp-batch")
_GGUF_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


class _Clock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def load_hf_model(path: Path, dtype: torch.dtype) -> Any:
    """The checkpoint as a transformers model (sdpa attention, eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _generation_config(model: Any, max_new_tokens: int) -> Any:
    import transformers

    eos = model.config.eos_token_id
    eos = eos if eos is not None else 0
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                         do_sample=False, eos_token_id=eos,
                                         pad_token_id=eos if isinstance(eos, int) else eos[0])


def _stats(label: str, workload: Workload, indices: range) -> RunStats:
    return RunStats(label, requests=len(indices), prompt_tokens=sum(len(workload.prompts[i]) for i in indices),
                    output_tokens=sum(workload.output_lens[i] for i in indices))


@torch.inference_mode()
def _hf_batch(model: Any, workload: Workload, indices: range, stats: RunStats) -> None:
    """One `generate` call over `indices`, left-padded; timings folded into `stats`."""
    import transformers

    prompts = [workload.prompts[i] for i in indices]
    width = max(map(len, prompts))
    config = _generation_config(model, max(workload.output_lens[i] for i in indices))
    ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _Clock()
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, generation_config=config,
                   logits_processor=transformers.LogitsProcessorList([clock]))
    t = clock.times
    stats.prefill_tokens += sum(map(len, prompts))
    stats.prefill_s += t[0] - start
    stats.decode_steps += len(t) - 1
    stats.decode_tokens += (len(t) - 1) * len(prompts)
    stats.decode_s += t[-1] - t[0]
    stats.steps += len(t)
    stats.peak_running = max(stats.peak_running, len(prompts))
    stats.latencies += [(t[0] - start, t[workload.output_lens[i] - 1] - start) for i in indices]


def _timed(stats: RunStats, batches: list[range], run: Any) -> RunStats:
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        run(batch)
    stats.elapsed_s, stats.cpu_s = time.perf_counter() - start, time.process_time() - cpu
    return stats


def run_hf(model: Any, workload: Workload, batch_size: int, label: str) -> RunStats:
    """`generate` over consecutive batches of `batch_size` requests (1: one at a time)."""
    n = len(workload.prompts)
    batches = [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    _hf_batch(model, Workload(((1, 2, 3, 4),), (2,)), range(1), RunStats("warmup"))
    stats = _stats(label, workload, range(n))
    return _timed(stats, batches, lambda b: _hf_batch(model, workload, b, stats))


def run_hf_continuous(model: Any, workload: Workload, batch_size: int, max_batch_tokens: int,
                      label: str = "hf-cb") -> RunStats:
    """transformers' continuous batching: every request submitted at once, each with its own
    length; at most `batch_size` requests and `max_batch_tokens` tokens per forward pass. (Not under
    inference_mode: the manager's thread updates tensors created here.)"""
    import transformers
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n, outs = len(workload.prompts), workload.output_lens
    longest = max(map(len, workload.prompts)) + max(outs)
    cb = transformers.ContinuousBatchingConfig(
        max_requests_per_batch=batch_size, max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
        num_blocks=math.ceil(min(batch_size, n) * longest / 256) + 1)
    hints = WorkloadHints(max_prompt_length=longest - max(outs), max_generated_length=max(outs), num_requests=n)
    stats = _stats(label, workload, range(n))
    with model.continuous_batching_context_manager(generation_config=_generation_config(model, max(outs)),
                                                   continuous_batching_config=cb, block=True, timeout=60,
                                                   workload_hints=hints) as manager:
        start, cpu = time.perf_counter(), time.process_time()
        for i, prompt in enumerate(workload.prompts):
            manager.add_request(list(prompt), request_id=str(i), max_new_tokens=outs[i], eos_token_id=-1,
                                record_timestamps=True)
        results: dict[str, Any] = {}
        while len(results) < n:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing the requests")
        stats.elapsed_s, stats.cpu_s = time.perf_counter() - start, time.process_time() - cpu
    stats.peak_running = min(batch_size, n)
    stats.steps = len({t for r in results.values() for t in r.timestamps})  # a step stamps its tokens at once
    stats.latencies = [(r.timestamps[0] - start, r.timestamps[-1] - start)
                       for r in (results[str(i)] for i in range(n))]
    return stats


def gguf_for(model_dir: Path, out_type: str, cache_dir: Path | None = None) -> Path:
    """The GGUF of `model_dir` in `out_type`, exported once and cached (keyed by the folder's path
    and the size and mtime of its weights)."""
    from nanoserve.model.checkpoint.gguf_export import export_gguf
    from nanoserve.model.checkpoint.loader import safetensors_files

    files = safetensors_files(model_dir)
    key = hashlib.sha256(repr([str(model_dir.resolve())] + [(f.stat().st_size, f.stat().st_mtime_ns)
                                                             for f in files]).encode()).hexdigest()[:12]
    cache = cache_dir or cache_root()
    out = cache / "gguf" / f"{model_dir.name}-{key}-{out_type}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        export_gguf(model_dir, tmp, out_type)
        os.replace(tmp, out)
    return out


def run_llama_cpp(gguf: Path, workload: Workload, threads: int, label: str) -> RunStats:
    """One request at a time through llama.cpp: the prompt in one `eval` (prefill), then one
    `eval` per token, the next token the argmax of the last logits (greedy, EOS ignored)."""
    import numpy as np
    from llama_cpp import Llama

    n_ctx = max(len(p) + m for p, m in zip(workload.prompts, workload.output_lens, strict=True))
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=min(n_ctx, 2048), n_ubatch=min(n_ctx, 512),
                n_threads=threads, n_threads_batch=threads, verbose=False)
    stats = _stats(label, workload, range(len(workload.prompts)))

    def one(i: int) -> None:
        llm.reset()
        start = time.perf_counter()
        llm.eval(list(workload.prompts[i]))
        first = time.perf_counter()
        for _ in range(workload.output_lens[i] - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        end = time.perf_counter()
        stats.prefill_tokens += len(workload.prompts[i])
        stats.prefill_s += first - start
        stats.decode_tokens += workload.output_lens[i] - 1
        stats.decode_steps += workload.output_lens[i] - 1
        stats.decode_s += end - first
        stats.steps += workload.output_lens[i]
        stats.latencies.append((first - start, end - start))

    llm.reset()
    llm.eval([1, 2, 3, 4])  # warm-up
    stats.peak_running = 1
    stats = _timed(stats, [range(i, i + 1) for i in range(len(workload.prompts))], lambda b: one(b[0]))
    llm.close()
    return stats


def run_llama_cpp_batched(gguf: Path, workload: Workload, batch_size: int, threads: int, label: str,
                          extra_buffers: bool = True, on_finished: Callable[[], object] | None = None) -> RunStats:
    """llama.cpp with up to `batch_size` sequences per `llama_decode`, greedy; steps that only
    decode and steps that only prefill are timed as such. `extra_buffers` is llama.cpp's
    `use_extra_bufts` (weights repacked for its AMX and CPU_REPACK kernels, the default);
    `on_finished` is called after the last step, while the model and context are still held (to
    read the resident memory then: llama.cpp maps the file, whose pages count once read)."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # what Llama(verbose=False) does
    n, outs, budget = len(workload.prompts), workload.output_lens, 2048
    longest = max(len(p) + m for p, m in zip(workload.prompts, outs, strict=True))
    params = lc.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    model = lc.llama_model_load_from_file(str(gguf).encode(), params)
    cp = lc.llama_context_default_params()
    # One KV buffer shared by all sequences (kv_unified): with one stream per sequence (the
    # default) llama.cpp's batched decodes lose their advantage over one at a time (docs/).
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = longest * min(batch_size, n), budget, 512, batch_size
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    ctx = lc.llama_init_from_model(model, cp)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(budget, 0, 1)
    stats = _stats(label, workload, range(n))
    slots: dict[int, list[int]] = {}  # slot -> [request, next position, tokens left to generate, last token]
    queue, free, start_of = list(range(n)), list(range(batch_size)), [0.0] * n
    first: dict[int, float] = {}
    start, cpu = time.perf_counter(), time.process_time()
    while queue or slots:
        rows = []  # (slot, token, position, wants logits)
        for slot, st in slots.items():
            rows.append((slot, st[3], st[1], True))
            st[1] += 1
        decoding = bool(rows)
        while queue and free and len(rows) + len(workload.prompts[queue[0]]) <= budget:
            i, slot = queue.pop(0), free.pop()
            prompt = workload.prompts[i]
            rows += [(slot, t, pos, pos == len(prompt) - 1) for pos, t in enumerate(prompt)]
            slots[slot], start_of[i] = [i, len(prompt), outs[i], -1], time.perf_counter()
        batch.n_tokens = len(rows)
        for j, (slot, t, pos, want) in enumerate(rows):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = t, pos, 1, want
            batch.seq_id[j][0] = slot
        step = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        now = time.perf_counter()
        stats.steps += 1
        if decoding and len(rows) == len(slots):
            stats.decode_steps, stats.decode_tokens = stats.decode_steps + 1, stats.decode_tokens + len(rows)
            stats.decode_s += now - step
        elif not decoding:
            stats.prefill_tokens, stats.prefill_s = stats.prefill_tokens + len(rows), stats.prefill_s + now - step
        stats.peak_running = max(stats.peak_running, len(slots))
        for j, (slot, _, _, want) in enumerate(rows):
            if not want:
                continue
            st = slots[slot]
            ptr = ctypes.cast(lc.llama_get_logits_ith(ctx, j), ctypes.POINTER(ctypes.c_float))
            st[3], st[2] = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,)))), st[2] - 1
            first.setdefault(st[0], now)
            if st[2] == 0:
                stats.latencies.append((first[st[0]] - start_of[st[0]], now - start_of[st[0]]))
                lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), slot, -1, -1)
                del slots[slot]
                free.append(slot)
    stats.elapsed_s, stats.cpu_s = time.perf_counter() - start, time.process_time() - cpu
    if on_finished is not None:
        on_finished()
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return stats


def check_peers(names: tuple[str, ...]) -> None:
    """Raises ValueError for an unknown peer or one whose package is not installed."""
    unknown = set(names) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; choose from {', '.join(PEERS)}")
    for prefix, module, package in (("hf-", "transformers", "transformers"), ("llama.cpp", "llama_cpp",
                                                                               "llama-cpp-python")):
        if any(n.startswith(prefix) for n in names) and importlib.util.find_spec(module) is None:
            raise ValueError(f"peer {next(n for n in names if n.startswith(prefix))} needs {package}: "
                             f"pip install -c constraints.txt {package}")


def run_peers(names: tuple[str, ...], model_dir: Path, dtype: torch.dtype, workloads: dict[int, Workload],
              max_batch_tokens: int, one_at_a_time_prompts: int | None) -> list[RunStats]:
    """Runs each named peer: hf-static, hf-cb and llama.cpp-batch once per batch size B on `workloads[B]`; the
    one-at-a-time peers (hf-sequential, llama.cpp) on the largest workload, only its first
    `one_at_a_time_prompts` requests when given (their rates do not depend on how many follow)."""
    check_peers(names)
    largest = max(workloads.values(), key=lambda w: len(w.prompts))
    head = one_at_a_time_prompts or len(largest.prompts)
    single = Workload(largest.prompts[:head], largest.output_lens[:head])
    runs: list[RunStats] = []
    hf = load_hf_model(model_dir, dtype) if any(n.startswith("hf-") for n in names) else None
    for name in names:
        if name == "hf-sequential":
            runs.append(run_hf(hf, single, 1, name))
        elif name == "hf-static":  # batch 1 is hf-sequential
            runs += [run_hf(hf, w, b, f"{name}-{b}") for b, w in sorted(workloads.items()) if b > 1]
        elif name == "hf-cb":
            runs += [run_hf_continuous(hf, w, b, max_batch_tokens, f"{name}-{b}") for b, w in sorted(workloads.items())]
        elif name == "llama.cpp-batch":
            gguf = gguf_for(model_dir, _GGUF_TYPES[dtype])
            runs += [run_llama_cpp_batched(gguf, w, b, torch.get_num_threads(), f"{name}-{b}")
                     for b, w in sorted(workloads.items())]
        else:
            out_type = "Q8_0" if name.endswith("q8_0") else _GGUF_TYPES[dtype]
            runs.append(run_llama_cpp(gguf_for(model_dir, out_type), single, torch.get_num_threads(), name))
    return runs
