"""Building an engine: the one place that loads models and sizes what runs them.

`build_engine(args)` loads the target (and, with speculative_model, the draft), picks the layer
ops, caps max_model_len by both models' contexts, sizes the KV pool (a default budget on the CPU;
on CUDA what `--gpu-memory-utilization` leaves after a measured activation peak, see
`memory_profile`), giving the draft its share of it, and decides on CUDA graphs.
`engine_from_model` does the part after loading for a model already in memory (the stand-in of
tests and benchmarks). `LLMEngine` itself sizes nothing: it gets a runner over a pool of a
known number of blocks.
"""

from __future__ import annotations

import logging

import torch

from nanoserve.attention import TritonAttention, select_backend
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.draft_model import DraftModelProposer
from nanoserve.engine.generation_config import sampling_defaults
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.memory_profile import activation_peak_bytes, kv_budget_bytes
from nanoserve.engine.model_protocol import KVShape, Model
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.spec_decode import NgramProposer, Proposer
from nanoserve.model import CausalLM, LoadedModel, load_model
from nanoserve.model.checkpoint.pooling import PoolingConfig, read_pooling_config
from nanoserve.model.config import ModelConfig
from nanoserve.model.layer_ops import CpuLayerOps, select_layer_ops
from nanoserve.parallel.megatron import TensorParallelCausalLM
from nanoserve.parallel.runner import TensorParallelLaunch, TensorParallelRunner
from nanoserve.parallel.worker import WorkerRanks
from nanoserve.tokenizer import Tokenizer
from nanoserve.tokenizer.chat_template import load_chat_template

log = logging.getLogger(__name__)


def build_engine(args: EngineArgs, loaded: LoadedModel | None = None) -> LLMEngine:
    """Loads the model (unless given) and the draft model (if any), and sizes the engine for them.
    With `tensor_parallel_size` > 1 the worker ranks start first, the model is sharded, and the
    draft model (if any) runs whole on rank 0."""
    if args.tensor_parallel_size > 1 and loaded is not None:
        raise ValueError("with tensor_parallel_size > 1 every rank loads args.model itself; pass no loaded model")
    if args.threads is not None:  # the C++ kernels take torch's thread count on every call
        torch.set_num_threads(args.threads)
    launch = TensorParallelLaunch(args) if args.tensor_parallel_size > 1 else None
    if loaded is None:
        log.info("loading %s", args.model or "the demo model")
        loaded = load_model(args.model, dtype=args.dtype, device=args.device, quantization=args.quantization)
    if args.chat_template is not None:
        loaded.tokenizer.override_chat_template(load_chat_template(args.chat_template))
        log.info("the model's chat template is replaced by --chat-template's")
    device = torch.device(args.device)
    loaded.model.ops = select_layer_ops(args.attention_backend, device, loaded.model.dtype)
    draft = _load_draft(args, loaded, device) if args.spec_method == "draft" else None
    if launch is not None:
        loaded = launch.shard(loaded, device)
    cfg = loaded.config
    args = args.resolved(cfg.max_position_embeddings, cfg.sliding_window,
                         None if draft is None else _context_limit(draft.config))
    for model in (loaded.model, *(() if draft is None else (draft.model,))):
        model.use_context(args.max_model_len)  # LongRoPE's factors follow the served context
    torch.manual_seed(args.seed)
    vocab_size = min(cfg.vocab_size, loaded.tokenizer.vocab_size)
    kv_shape = _kv_shape(loaded.model.cfg)  # a shard's: its share of the KV heads
    bytes_per_block = kv_shape.bytes_per_block(args.block_size, loaded.model.dtype)
    if draft is not None:  # the draft keeps a pool of as many blocks beside the target's
        draft_shape = _kv_shape(draft.config)
        bytes_per_block += draft_shape.bytes_per_block(args.block_size, draft.model.dtype)
    free_memory = None
    if device.type == "cuda" and args.num_kv_blocks is None and args.kv_cache_memory is None and launch is None:
        free_memory = gpu_kv_budget(loaded.model, kv_shape, args, device)
    num_blocks = args.resolve_num_blocks(bytes_per_block, free_memory)
    proposer: Proposer | None = None
    if args.spec_method == "ngram":
        proposer = NgramProposer()
    elif draft is not None:
        drafter = DraftModelProposer(draft.model, draft_shape, num_blocks, args.block_size, vocab_size, device,
                                     args.speculative_min_confidence, select_backend(args.attention_backend, device))
        use_cuda_graphs(drafter.runner, draft_shape.num_kv_heads, args)  # its single-token passes
        proposer = drafter
    defaults = sampling_defaults(args.generation_config, loaded.generation_config)
    if defaults:
        log.info("default sampling parameters from %s: %s",
                 "the model's generation_config.json" if args.generation_config == "auto" else args.generation_config,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    try:
        pooling: PoolingConfig | None = read_pooling_config(loaded.path, cfg.hidden_size)
    except ValueError as e:
        log.warning("embeddings are off: %s", e)
        pooling = None
    return engine_from_model(loaded.model, loaded.tokenizer, kv_shape, vocab_size, args,
                             loaded.tokenizer.stop_token_ids, proposer, num_blocks, defaults,
                             None if launch is None else launch.workers, pooling)


def engine_from_model(model: Model, tokenizer: Tokenizer | None, kv_shape: KVShape, vocab_size: int,
                      args: EngineArgs, stop_token_ids: frozenset[int] = frozenset(),
                      proposer: Proposer | None = None, num_blocks: int | None = None,
                      sampling_defaults: dict[str, float | int] | None = None,
                      workers: WorkerRanks | None = None, pooling: PoolingConfig | None = None) -> LLMEngine:
    """An engine around a model already loaded. `args` must be resolved (max_model_len set).
    `num_blocks=None` sizes the pool from the memory budget `args` gives (no GPU profile).
    `tokenizer=None` skips detokenization (token ids only). `sampling_defaults`: the values of
    SamplingParams fields a request leaves unset (see `generation_config`). `workers`: the worker
    ranks of a tensor-parallel `model` (rank 0's shard), which then steps without CUDA graphs.
    `pooling`: how the model makes embeddings (None: it serves none)."""
    if num_blocks is None:
        num_blocks = args.resolve_num_blocks(kv_shape.bytes_per_block(args.block_size, model.dtype))
    device = torch.device(args.device)
    backend = select_backend(args.attention_backend, device)
    if workers is not None:
        assert isinstance(model, TensorParallelCausalLM)
        runner: ModelRunner = TensorParallelRunner(model, workers, kv_shape, num_blocks, args.block_size, vocab_size,
                                                   stop_token_ids, device, backend)
    else:
        runner = ModelRunner(model, kv_shape, num_blocks, args.block_size, vocab_size, stop_token_ids, device,
                             backend)
        use_cuda_graphs(runner, kv_shape.num_kv_heads, args)
    return LLMEngine(runner, num_blocks, tokenizer, args, proposer, sampling_defaults, pooling)


def use_cuda_graphs(runner: ModelRunner, num_kv_heads: int, args: EngineArgs) -> None:
    """Captures the runner's decode steps as CUDA graphs on a CUDA device unless `enforce_eager`;
    they need the Triton attention backend (its fixed-split decode path is graph-safe) and a model
    without sliding-window layers (those attend through `TorchAttention`) or mixture-of-experts
    layers."""
    if runner.device.type != "cuda" or args.enforce_eager:
        return
    if not isinstance(runner.backend, TritonAttention):
        log.info("CUDA graphs need the triton attention backend; decode steps run eagerly")
        return
    if isinstance(runner.model, CausalLM) and runner.model.cfg.layer_windows:
        log.info("the model has sliding-window layers, which the triton kernels do not implement; "
                 "decode steps run eagerly")
        return
    if isinstance(runner.model, CausalLM) and runner.model.cfg.moe_layers:
        log.info("the model has mixture-of-experts layers, whose grouping by expert reads the routing on the "
                 "host (no CUDA graph can hold it); decode steps run eagerly")
        return
    assert args.max_model_len is not None
    runner.use_decode_graphs(num_kv_heads, args.max_num_seqs, args.max_model_len)


def gpu_kv_budget(model: CausalLM, kv_shape: KVShape, args: EngineArgs, device: torch.device) -> int:
    """Bytes for the KV pools on a GPU: `gpu_memory_utilization` of its memory, less what is in use
    now (weights included) and the activation peak of the largest step (see `memory_profile`)."""
    assert args.max_model_len is not None
    peak = activation_peak_bytes(model, kv_shape, args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len,
                                 args.block_size, select_backend(args.attention_backend, device), device)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, peak, args.gpu_memory_utilization)
    log.info("GPU memory: %.1f GiB total, %.1f GiB in use, activation peak %.2f GiB -> %.1f GiB for KV",
             total / 2**30, (total - free) / 2**30, peak / 2**30, budget / 2**30)
    return budget


def _load_draft(args: EngineArgs, target: LoadedModel, device: torch.device) -> LoadedModel:
    """The draft model, on the target's layer ops; it must share the target's tokenizer."""
    dtype: str | torch.dtype = args.speculative_dtype
    if dtype == "auto":  # a draft pass is a few small products: bf16 halves the bytes they stream
        dtype = torch.bfloat16 if isinstance(target.model.ops, CpuLayerOps) else target.model.dtype
    draft = load_model(args.speculative_model, dtype=dtype, device=device)
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise ValueError(f"the draft model {args.speculative_model} does not share the target's tokenizer")
    draft.model.ops = target.model.ops
    return draft


def _kv_shape(cfg: ModelConfig) -> KVShape:
    return KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)


def _context_limit(cfg: ModelConfig) -> int:
    """The longest context a model attends exactly here (no sliding window is implemented)."""
    return cfg.max_position_embeddings if cfg.sliding_window is None else min(cfg.max_position_embeddings,
                                                                              cfg.sliding_window)
