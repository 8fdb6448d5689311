"""PromptPool: chat templates and tokenizing in worker processes, each call under a deadline and a
memory limit; a worker that passes either is replaced, and the pool goes on serving."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoserve.tokenizer import Tokenizer
from nanoserve.tokenizer.prompt_pool import PromptLimits, PromptPool, PromptWorkError

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Each turn keeps a new 1 MB string: past the worker's address-space limit in about a thousand turns.
HOARD = "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}"


@pytest.fixture(scope="module")
def tok(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(demo_dir)


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    other = copy.copy(tok)
    other.chat_template = template
    return other


@pytest.fixture
def run() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as runner:
        yield runner


def test_calls_give_what_the_tokenizer_gives(tok: Tokenizer, run: asyncio.Runner) -> None:
    pool = PromptPool(tok, 2, PromptLimits(timeout_s=30), "test")
    try:
        async def both() -> list[list[int]]:
            return list(await asyncio.gather(pool.call("encode_chat", MESSAGES), pool.call("encode", "a b c " * 1000)))

        chat, text = run.run(both())
        assert chat == tok.encode_chat(MESSAGES) and text == tok.encode("a b c " * 1000)
        with pytest.raises(RuntimeError, match="unexpected keyword argument 'bogus'"):
            run.run(pool.call("encode", "x", bogus=True))
        with pytest.raises(ValueError, match="not a tokenizer operation"):
            run.run(pool.call("backend"))
    finally:
        pool.close()


def test_a_template_past_its_deadline_is_stopped_and_its_worker_replaced(tok: Tokenizer,
                                                                         run: asyncio.Runner) -> None:
    pool = PromptPool(_with_template(tok, SPIN), 1, PromptLimits(timeout_s=1.0), "test")
    try:
        first = pool._workers[0]
        with pytest.raises(PromptWorkError, match="took more than 1 s"):
            run.run(pool.call("encode_chat", MESSAGES))
        assert not first.alive and pool.size == 1 and pool._workers[0] is not first
        assert run.run(pool.call("encode", "hello")) == tok.encode("hello")  # the new worker serves
    finally:
        pool.close()


def test_a_template_past_its_memory_limit_fails_alone(tok: Tokenizer, run: asyncio.Runner) -> None:
    pool = PromptPool(_with_template(tok, HOARD), 1, PromptLimits(timeout_s=60, memory_bytes=1 << 30), "test")
    try:
        with pytest.raises(ValueError, match="memory"):
            run.run(pool.call("encode_chat", MESSAGES))
        assert run.run(pool.call("encode", "hello")) == tok.encode("hello")
    finally:
        pool.close()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads a worker's mapped libraries from /proc")
def test_workers_do_not_load_torch(tok: Tokenizer, run: asyncio.Runner) -> None:
    pool = PromptPool(tok, 1, PromptLimits(timeout_s=30), "test")
    try:
        run.run(pool.call("encode", "hello"))  # the worker has started and read its tokenizer
        maps = Path(f"/proc/{pool._workers[0].process.pid}/maps").read_text()
        assert "libtokenizers" in maps or "tokenizers" in maps
        assert "libtorch" not in maps
    finally:
        pool.close()
