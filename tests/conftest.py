"""Fixtures: tiny random checkpoints of every supported family, built with transformers; the demo
model's engine and a server on it, one of each per test module (a module may define its own)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI

from nanoserve.engine.llm_engine import LLMEngine

from support.server import make_engine, serve

# Small shapes that still exercise each family's switches: GQA everywhere, llama3 rope scaling with
# an original context shorter than the test sequences, Qwen3's head_dim != hidden / heads, ties.
_SHAPES: dict[str, dict[str, Any]] = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                    sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint, built once per session in a private cache."""
    from nanoserve.model.demo import demo_model_path

    return demo_model_path(tmp_path_factory.mktemp("demo-cache"))


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> Callable[..., Path]:
    """Builds (once per family and overrides) a tiny random transformers checkpoint with the demo
    tokenizer, saved with save_pretrained as safetensors."""
    import transformers

    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, **overrides: Any) -> Path:
        key = (family, repr(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
        cls_name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
        fields = dict(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            bos_token_id=None, initializer_range=0.1, **_SHAPES[family],
        )
        cfg = getattr(transformers, f"{cls_name}Config")(**{**fields, **overrides})
        torch.manual_seed(1234)
        model = getattr(transformers, f"{cls_name}ForCausalLM")(cfg).eval()
        path = tmp_path_factory.mktemp(f"ckpt-{family}")
        model.save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_dir / name, path / name)
        cache[key] = path
        return path

    return make


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for the module's tests (on a loaded 2-core machine a second one
    mostly adds barrier waits and scheduler time slices), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (a Playwright `Browser`) for one test module; skips, saying why, where
    no browser can be had (tests/support/browser.py)."""
    from support.browser import launch_chromium, unavailable_reason

    if reason := unavailable_reason():
        pytest.skip(f"no browser for the web page tests: {reason}")
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def browser_page(chromium: Any) -> Iterator[Any]:
    """A Playwright `Page` in a fresh browser context (empty localStorage, 1280x800). An uncaught
    JavaScript error on the page fails the test."""
    context = chromium.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(10_000)
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


@pytest.fixture(scope="module")
def engine(demo_dir: Path) -> LLMEngine:
    """The demo model's engine with the server tests' settings (`make_engine`)."""
    return make_engine(demo_dir)


@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    """`engine` behind a fresh app on a free loopback port: (base url, app)."""
    with serve(engine) as served:
        yield served
