"""Offline API in the shape vLLM users know: `LLM(model).generate(prompts, sampling_params)`, and
`LLM(model).embed(prompts)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, cast

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.engine.sampling_params import PoolingParams, SamplingParams
from nanoserve.model import LoadedModel
from nanoserve.runtime.builder import build_engine


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
        single = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
        batch = cast(list[str | Sequence[int]], [prompts] if single else list(prompts))
        params = self._params(sampling_params, len(batch), self.engine.sampling_defaults)
        requests = []
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            ids = self._encode(prompt)
            requests.append((str(next(self._ids)), prompt if isinstance(prompt, str) else None, ids, p,
                             priority[i] if priority else 0))
        return self._run(requests)

    def embed(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
              dimensions: int | None = None) -> list[list[float]]:
        """Every prompt's embedding, in prompt order: pooled as the model declares and L2-normalized
        (see `nanoserve.engine.pooling`), cut to `dimensions` first where the model allows it.
        Raises ValueError for a model that makes no embeddings or a size it does not allow."""
        pooling = self.engine.limits.pooling
        if pooling is None:
            raise ValueError("this model makes no embeddings")
        single = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
        batch = cast(list[str | Sequence[int]], [prompts] if single else list(prompts))
        params = SamplingParams(pooling=PoolingParams(pooling.method, dimensions))
        outputs = self._run([(str(next(self._ids)), p if isinstance(p, str) else None, self._encode(p), params, 0)
                             for p in batch])
        embeddings = [o.embedding for o in outputs]
        assert all(e is not None for e in embeddings), "a pooling request ended without its embedding"
        return cast(list[list[float]], embeddings)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation through the model's chat template (with the extra template
        variables `chat_template_kwargs`, e.g. `enable_thinking`), then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        assert self.tokenizer is not None
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                              **(chat_template_kwargs or {}))
                   for c in conversations]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            assert self.tokenizer is not None
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (what `sampling_params=None` uses)."""
        return SamplingParams(**self.engine.sampling_defaults)  # type: ignore[arg-type]

    @staticmethod
    def _params(sp: SamplingParams | Sequence[SamplingParams] | None, n: int,
                defaults: dict[str, float | int]) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams(**defaults) for _ in range(n)]  # type: ignore[arg-type]
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
            out = self.engine.step()
            if out.failed:  # validate compiled every constraint: cannot happen
                raise RuntimeError(f"the engine failed requests: {out.failed}")
            for delta in out.deltas:
                outputs[delta.request_id].accumulate(delta)
        return [outputs[rid] for rid, *_ in requests]
