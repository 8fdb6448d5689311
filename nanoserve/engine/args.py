"""Engine arguments, with the names vLLM users know; the CLI reads its defaults from here."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from nanoserve.model.quant.methods import QUANTIZATION_METHODS

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 2 << 30


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """Invariants once built by `resolved`: max_model_len is set; kv is 'paged' or 'contiguous'."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str = "none"  # none; int8: a safetensors checkpoint's layer matrices as q8_0 blocks; dense
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool (default 2 GiB on CPU, capped by need)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    enable_prefix_caching: bool = True
    kv: str = "paged"
    seed: int = 0
    scheduling_policy: str = "fcfs"
    prefill_order: str = "fcfs"  # or "shared": the prompts in progress share each step's prefill budget
    speculative_method: str | None = None  # "ngram" or "draft"
    speculative_model: str | None = None  # the draft model (implies speculative_method="draft")
    num_speculative_tokens: int = 4
    speculative_min_confidence: float = 0.2  # draft model: stop after a draft given less probability
    speculative_disable_by_batch_size: int | None = None  # no drafts while more sequences than this run
    speculative_dtype: str = "auto"  # the draft model's: auto (bf16 on nanoserve's CPU kernels, else the target's)
    attention_backend: str = "auto"  # auto (triton on CUDA; cpu, else torch, elsewhere), cpu, torch or triton
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's memory for weights, activations and KV
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    chat_template: str | None = None  # overrides the model's chat template: a file's path, else the Jinja text
    generation_config: str = "auto"  # sampling defaults: auto (the model's generation_config.json), vllm, a folder
    tensor_parallel_size: int = 1  # ranks the model is sharded over (nanoserve.parallel)
    nnodes: int = 1  # machines the ranks span (MASTER_ADDR / MASTER_PORT name rank 0's)
    node_rank: int = 0  # this machine's index; above 0 it runs only its worker ranks
    distributed_timeout: float = 60.0  # seconds a tensor-parallel collective may wait before it fails
    threads: int | None = None  # compute threads of the engine (torch's and the C++ kernels'); None: torch's

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")
        if self.kv not in ("paged", "contiguous"):
            raise ValueError(f"kv must be 'paged' or 'contiguous', got {self.kv!r}")
        for name in ("threads", "num_kv_blocks", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be ngram or draft, got {self.speculative_method!r}")
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError("speculative_method='draft' needs a draft model (speculative_model)")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise ValueError("speculative_model is a draft model; it does not go with speculative_method='ngram'")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ValueError("speculative_disable_by_batch_size must be at least 1")
        if self.speculative_dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"speculative_dtype must be auto, bfloat16, float32 or float16, "
                             f"got {self.speculative_dtype!r}")
        if not 0.0 <= self.speculative_min_confidence <= 1.0:
            raise ValueError(f"speculative_min_confidence must be in [0, 1], got {self.speculative_min_confidence}")
        if self.tensor_parallel_size < 1 or self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a positive multiple of "
                             f"nnodes ({self.nnodes})")
        if self.tensor_parallel_size > 1 and self.quantization != "none":
            raise ValueError("tensor parallelism shards dense weights only; quantization must be 'none' with "
                             "tensor_parallel_size > 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got {self.node_rank}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def spec_method(self) -> str | None:
        """The speculation in effect: a draft model implies 'draft'."""
        return "draft" if self.speculative_model is not None else self.speculative_method

    def resolved(self, model_max_len: int, sliding_window: int | None = None,
                 draft_max_len: int | None = None) -> EngineArgs:
        """Fills max_model_len from the model: at most its max_position_embeddings and, with a
        draft model, the draft's context too (every sequence is drafted for to its end).
        Sliding-window attention is not implemented, so the context is capped at the window, where
        full attention is exact."""
        limits = {"the model's max_position_embeddings": model_max_len}
        if sliding_window is not None:
            limits["the model's sliding window"] = sliding_window
        if draft_max_len is not None:
            limits["the draft model's context"] = draft_max_len
        why, limit = min(limits.items(), key=lambda item: item[1])
        length = self.max_model_len or limit
        if length > limit:
            log.warning("max_model_len %d exceeds %s (%d); capping", length, why, limit)
            length = limit
        return dataclasses.replace(self, max_model_len=length)

    def resolve_num_blocks(self, bytes_per_block: int, free_memory: int | None = None) -> int:
        """Pool size: num_kv_blocks if given, else kv_cache_memory if given, else `free_memory` (on
        CUDA: what `gpu_memory_utilization` leaves after weights and activations) or 2 GiB, never
        more than max_num_seqs full-length sequences need."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        assert self.max_model_len is not None
        if self.kv_cache_memory is not None:
            what, budget = "kv_cache_memory", self.kv_cache_memory
        elif free_memory is not None:
            what, budget = f"the memory gpu_memory_utilization={self.gpu_memory_utilization} leaves", free_memory
        else:
            what, budget = "the default KV memory", DEFAULT_KV_CACHE_MEMORY
        blocks = budget // bytes_per_block
        if blocks < 1:
            raise ValueError(f"{what} ({budget} bytes) is smaller than one KV block ({bytes_per_block} bytes)")
        from nanoserve.kv.manager import blocks_needed  # here: the manager imports numpy, the CLI's parser need not

        need = self.max_num_seqs * blocks_needed(self.max_model_len, self.block_size)
        return blocks if self.kv_cache_memory is not None else min(need, blocks)
