"""POST /v1/embeddings: one pooling engine request per input (see `nanoserve.engine.pooling`),
pooled as the model declares (last token or mean; `PoolingConfig`), L2-normalized.

`encoding_format` "float" (the default) returns lists of floats; "base64" the little-endian fp32
bytes of each vector, base64-encoded, as OpenAI's API does. `dimensions` cuts each vector before it
is normalized, only for a model that declares Matryoshka embeddings (else a 400 naming it). Usage
counts the input tokens (`prompt_tokens` = `total_tokens`).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanoserve.engine.outputs import EngineLimits, SequenceDelta
from nanoserve.engine.sampling_params import PoolingParams, SamplingParams
from nanoserve.runtime.async_engine import EngineError
from nanoserve.server.protocol.embeddings import EmbeddingRequest
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.serving import Serving, UsageTally, collect, engine_error, validate_prompt
from nanoserve.tokenizer import Tokenizer


def pooling_params(limits: EngineLimits, dimensions: int | None) -> SamplingParams:
    """The engine's params of every input of one request: 400 when the model makes no embeddings
    or, naming `dimensions`, when it may not cut them to that size."""
    if limits.pooling is None:
        raise APIError(400, "this model makes no embeddings", param="model")
    if dimensions is not None:
        try:
            limits.pooling.check_dimensions(dimensions)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions") from e
    return SamplingParams(pooling=PoolingParams(limits.pooling.method, dimensions))


async def prepare_embeddings(serving: Serving, limits: EngineLimits, tok: Tokenizer | None, body: EmbeddingRequest,
                             params: SamplingParams) -> list[list[int]]:
    """Each input's token ids (text tokenized in the prompt workers), validated (length,
    vocabulary)."""
    ids = []
    for given in body.inputs():
        if isinstance(given, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="input")
            ids.append(await serving.prompts.encode(tok, limits, given, "input"))
        else:
            ids.append(list(given))
        validate_prompt(limits, ids[-1], params, "input")
    return ids


async def create_embedding(serving: Serving, body: EmbeddingRequest, request: Request) -> Response:
    serving.check_request(body, body.model)
    serving.admit(len(body.inputs()))
    info = serving.running_info()
    params = pooling_params(info.limits, body.dimensions)
    ids = await prepare_embeddings(serving, info.limits, info.tokenizer, body, params)
    stream = serving.submit(ids, params, 0, "embd")
    position = {rid: i for i, rid in enumerate(stream.request_ids)}
    vectors: list[list[float] | None] = [None] * len(ids)
    usage = UsageTally()

    def on_delta(d: SequenceDelta) -> None:
        usage.add(d)
        if d.embedding is not None:
            vectors[position[d.request_id]] = d.embedding

    try:
        if not await collect(request, stream, on_delta):
            return Response(status_code=499)
    except EngineError as e:
        raise engine_error(e) from e
    prompt_tokens = usage.body()["prompt_tokens"]
    return JSONResponse({
        "object": "list", "model": serving.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })


def _encode(vector: list[float] | None, encoding_format: str | None) -> Any:
    assert vector is not None, "a pooling request ended without its embedding"
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
