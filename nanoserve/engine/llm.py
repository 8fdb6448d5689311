"""Offline API in the shape vLLM users know: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.attention import select_backend
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.draft_model import DraftModelProposer
from nanoserve.engine.llm_engine import LLMEngine, SequenceDelta, use_cuda_graphs
from nanoserve.engine.memory_profile import activation_peak_bytes, kv_budget_bytes
from nanoserve.engine.model_runner import KVShape
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import NgramProposer, Proposer
from nanoserve.model import CausalLM, LoadedModel, load_model
from nanoserve.model.layer_ops import CpuLayerOps, select_layer_ops

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples. `logprobs[i]` is the raw logprob of token_ids[i];
    `top_logprobs[i]` the (id, logprob) of the most likely tokens at that step."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


def build_engine(args: EngineArgs, loaded: LoadedModel | None = None) -> LLMEngine:
    """Loads the model (unless given) and sizes the engine for it."""
    if loaded is None:
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    cfg = loaded.config
    args = args.resolved(cfg.max_position_embeddings, cfg.sliding_window)
    torch.manual_seed(args.seed)
    vocab = min(cfg.vocab_size, loaded.tokenizer.vocab_size)
    kv_shape = KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    bytes_per_block = kv_shape.bytes_per_block(args.block_size, loaded.model.dtype)
    device = torch.device(args.device)
    loaded.model.ops = select_layer_ops(args.attention_backend, device, loaded.model.dtype)
    draft: LoadedModel | None = None
    if args.spec_method == "draft":
        draft_dtype: str | torch.dtype = args.speculative_dtype
        if draft_dtype == "auto":  # a draft pass is a few small products: bf16 halves the bytes they stream
            draft_dtype = torch.bfloat16 if isinstance(loaded.model.ops, CpuLayerOps) else loaded.model.dtype
        draft = load_model(args.speculative_model, dtype=draft_dtype, device=device)
        if draft.tokenizer.backend.get_vocab() != loaded.tokenizer.backend.get_vocab():
            raise ValueError(f"the draft model {args.speculative_model} does not share the target's tokenizer")
        draft.model.ops = loaded.model.ops
        dc = draft.config
        draft_shape = KVShape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim)
        bytes_per_block += draft_shape.bytes_per_block(args.block_size, draft.model.dtype)  # the draft's pool too
    free_memory = None
    if device.type == "cuda" and args.num_kv_blocks is None and args.kv_cache_memory is None:
        free_memory = _gpu_kv_memory(loaded.model, kv_shape, args, device)
    num_blocks = args.resolve_num_blocks(bytes_per_block, free_memory)
    proposer: Proposer | None = None
    if args.spec_method == "ngram":
        proposer = NgramProposer()
    elif draft is not None:
        proposer = DraftModelProposer(draft.model, draft_shape, num_blocks, args.block_size, vocab, device,
                                      args.speculative_min_confidence, select_backend(args.attention_backend, device))
        use_cuda_graphs(proposer.runner, draft_shape.num_kv_heads, args)  # its single-token passes
    return LLMEngine(loaded.model, loaded.tokenizer, kv_shape, vocab, args, loaded.tokenizer.stop_token_ids,
                     proposer, num_blocks)


def _gpu_kv_memory(model: CausalLM, kv_shape: KVShape, args: EngineArgs, device: torch.device) -> int:
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


def accumulate(outputs: dict[str, RequestOutput], delta: SequenceDelta) -> None:
    """Folds one step's delta into the request's running output."""
    req = outputs[delta.request_id]
    out = req.outputs[delta.index]
    out.text += delta.text
    out.token_ids.extend(delta.token_ids)
    out.finish_reason = delta.finish_reason
    req.num_cached_tokens = delta.num_cached_tokens
    if delta.logprobs is not None:
        (out.logprobs if out.logprobs is not None else _init(out, "logprobs")).extend(delta.logprobs)
        (out.top_logprobs if out.top_logprobs is not None else _init(out, "top_logprobs")).extend(
            delta.top_logprobs or [])


def _init(out: CompletionOutput, name: str) -> list[Any]:
    setattr(out, name, [])
    return getattr(out, name)


class LLM:
    """Runs batches of prompts to completion with continuous batching.

    `LLM(model, **engine_args)`: model is a folder, a .gguf file, a hub id or None (demo model);
    engine_args are the fields of EngineArgs (max_model_len, max_num_seqs, block_size, kv, ...).
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **engine_args: Any) -> None:
        self.engine = build_engine(EngineArgs(model=model, **engine_args), loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt (a string or a list of token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        batch: list[str | Sequence[int]] = list(prompts)  # type: ignore[arg-type]
        params = self._params(sampling_params, len(batch))
        requests = []
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            ids = self._encode(prompt)
            requests.append((str(next(self._ids)), prompt if isinstance(prompt, str) else None, ids, p,
                             priority[i] if priority else 0))
        return self._run(requests)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Renders each conversation through the model's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        assert self.tokenizer is not None
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            assert self.tokenizer is not None
            return self.tokenizer.encode(prompt)
        return list(prompt)

    @staticmethod
    def _params(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [dataclasses.replace(sp) for _ in range(n)]
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return list(sp)

    def _run(self, requests: list[tuple[str, str | None, list[int], SamplingParams, int]]) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        for _, _, ids, p, _ in requests:
            self.engine.validate(ids, p)
        for rid, text, ids, p, prio in requests:
            self.engine.add_request(rid, ids, p, priority=prio)
            outputs[rid] = RequestOutput(rid, text, ids, [CompletionOutput(i) for i in range(p.n)])
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                accumulate(outputs, delta)
        return [outputs[rid] for rid, *_ in requests]
