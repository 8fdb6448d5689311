"""One answer per prompt: a request's greedy tokens do not depend on the requests that share its
steps, on its place in the batch, or on fields that do not change its output (`prompt_logprobs`,
`logprobs`, `n`).

Each model (dense bf16 and fp32 weights, a Q8_0 GGUF file and a Q4_K_M-like k-quant file, each
computed in bf16 and in fp32) runs one prompt through the public `LLM` API: alone; in the middle of
15 random prompts of mixed lengths, under a token budget small enough that chunked prefill splits
the long ones (so the target's steps carry other sequences' prefill chunks, and its own prompt is
cut at other places); alone with `prompt_logprobs` (its prompt rows then go through the LM head
with it); and with `n=2` and `logprobs`. All give identical tokens for 64 greedy steps, and the
same logprobs bit for bit (so a difference too small to flip a token of these tiny models is caught
too).

What makes this fail: any product, attention or LM head whose numeric path depends on the number of
rows in the step (a switch from the C++ products to a BLAS GEMM past some row count, a reduction
order chosen by the number of rows, bf16-rounded logits). The budget of 48 tokens puts prefill
chunks of up to 48 rows next to decode steps of 1 to 16 rows; the dense models' MLP rows of 1,024
values reach the long-row loops of the bf16 products. The prefix cache is off so that each run
computes the target's prompt itself rather than reading the blocks of the previous run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from test_quantized_models import _k_type, _retyped

from nanoserve import LLM, SamplingParams
from nanoserve.model.checkpoint.gguf_export import export_gguf

STEPS = 64
BUDGET = 48  # max_num_batched_tokens: prompts of up to ~120 tokens take several chunks
TARGET_LEN = 70
OTHERS = 15
# Head size 32 and 64 (hidden / 4 heads): sizes the C++ attention kernel takes (the torch backend,
# which the engine uses for other sizes, batches its SDPA calls by step and is not batch invariant).
DENSE_SHAPE = {"hidden_size": 128, "intermediate_size": 1024}  # down_proj rows of 1,024 values
K_MIX_SHAPE = {"hidden_size": 256, "intermediate_size": 1024}  # whole 256-value k-quant blocks


@pytest.fixture(scope="module")
def model_path(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[[str], Path]:
    """"dense" -> the safetensors folder; "Q8_0" / "Q4_K_M" -> a GGUF file made from it (Q4_K_M:
    Q4_K matrices with Q6_K attn_v / ffn_down / output and Q5_K in places, as llama.cpp mixes them)."""
    out = tmp_path_factory.mktemp("invariance")

    def make(kind: str) -> Path:
        if kind == "dense":
            return make_checkpoint("llama", **DENSE_SHAPE)
        if kind == "Q8_0":
            return export_gguf(make_checkpoint("llama", **DENSE_SHAPE), out / "q8_0.gguf", "Q8_0")
        f32 = export_gguf(make_checkpoint("llama", **K_MIX_SHAPE), out / "f32.gguf")
        return _retyped(f32, out / "q4_k_m.gguf", _k_type)

    return make


def _greedy(max_tokens: int = STEPS, **fields: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


@pytest.mark.slow  # six engines; tests/model/test_layer_ops.py checks the kernels' invariance in the fast tier
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["dense", "Q8_0", "Q4_K_M"])
def test_greedy_tokens_do_not_depend_on_the_batch(model_path: Callable[[str], Path], kind: str, dtype: str) -> None:
    llm = LLM(str(model_path(kind)), dtype=dtype, max_model_len=256, max_num_batched_tokens=BUDGET,
              enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    rng = random.Random(27)
    target = [rng.randrange(vocab) for _ in range(TARGET_LEN)]
    others = [[rng.randrange(vocab) for _ in range(rng.randint(1, 120))] for _ in range(OTHERS)]

    alone = llm.generate([target], _greedy())[0].outputs[0]
    assert len(alone.token_ids) == STEPS
    batch = [*others[:7], target, *others[7:]]
    params = [_greedy(max_tokens=rng.randint(8, STEPS)) for _ in others]
    in_batch = llm.generate(batch, [*params[:7], _greedy(logprobs=1), *params[7:]])[7].outputs[0]
    with_prompt_logprobs = llm.generate([target], _greedy(prompt_logprobs=1, logprobs=1))[0]
    siblings = llm.generate([target], _greedy(n=2, logprobs=3))[0].outputs

    assert with_prompt_logprobs.prompt_logprobs is not None
    runs = {"in a batch": in_batch, "with prompt_logprobs": with_prompt_logprobs.outputs[0],
            "first of n=2": siblings[0], "second of n=2": siblings[1]}
    for name, run in runs.items():
        assert run.token_ids == alone.token_ids, name
        # Not only the same tokens: the same logits, bit for bit (a logprob is a function of the row).
        assert run.logprobs == in_batch.logprobs, name
