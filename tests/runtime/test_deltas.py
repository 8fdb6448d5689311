"""Deltas that piled up while the event loop was busy: merged per sequence (`coalesce`), taken in
one pass by `OutputStream`, and streamed as multi-token SSE chunks that reassemble exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from nanoserve.engine.outputs import PromptLogprob, SequenceDelta
from nanoserve.runtime.async_engine import AsyncEngine, EngineError, OutputStream
from nanoserve.runtime.deltas import coalesce
from nanoserve.server.serving import Serving
from nanoserve.server.serving_completion import _events
from nanoserve.tokenizer import Tokenizer


def _delta(rid: str, index: int, token: int, text: str, finish: str | None = None,
           logprob: float | None = None) -> SequenceDelta:
    lp = None if logprob is None else [logprob]
    top = None if logprob is None else [[(token, logprob)]]
    return SequenceDelta(rid, index, [token], text, finish, lp, top, num_prompt_tokens=3)


def test_coalesce_merges_each_sequence_in_order() -> None:
    deltas = [_delta("a", 0, 1, "x", logprob=-1.0), _delta("a", 1, 5, "p"), _delta("a", 0, 2, "", logprob=-2.0),
              _delta("b", 0, 9, "q"), _delta("a", 0, 3, "yz", "length", logprob=-3.0), _delta("a", 1, 6, "r")]
    before = [dataclasses.replace(d) for d in deltas]
    out = coalesce(deltas)
    assert [(d.request_id, d.index) for d in out] == [("a", 0), ("a", 1), ("b", 0)]
    a0 = out[0]
    assert (a0.token_ids, a0.text, a0.finish_reason) == ([1, 2, 3], "xyz", "length")
    assert a0.logprobs == [-1.0, -2.0, -3.0] and a0.top_logprobs == [[(1, -1.0)], [(2, -2.0)], [(3, -3.0)]]
    assert (out[1].token_ids, out[1].text, out[1].logprobs) == ([5, 6], "pr", None)
    assert deltas == before  # inputs untouched


def test_coalesce_keeps_the_prompt_logprobs_of_a_first_delta() -> None:
    first = dataclasses.replace(_delta("a", 0, 1, "x"), prompt_logprobs=[None, PromptLogprob(7, -0.5, 1, [])])
    out = coalesce([first, _delta("a", 0, 2, "y"), _delta("a", 0, 3, "z", "stop")])
    assert len(out) == 1 and out[0].prompt_logprobs == first.prompt_logprobs and out[0].text == "xyz"


def test_coalesce_sums_the_prediction_counts() -> None:
    steps = [dataclasses.replace(_delta("a", 0, t, "x"), accepted_prediction_tokens=a, rejected_prediction_tokens=r)
             for t, a, r in ((1, 0, 0), (2, 4, 0), (3, 1, 3))]
    (out,) = coalesce(steps)
    assert (out.accepted_prediction_tokens, out.rejected_prediction_tokens) == (5, 3)


def test_coalesce_never_merges_past_a_finish_or_across_logprob_shapes() -> None:
    deltas = [_delta("a", 0, 1, "x", "stop"), _delta("a", 0, 2, "y"), _delta("a", 0, 3, "z", logprob=-1.0)]
    assert coalesce(deltas) == deltas
    assert coalesce([]) == []


def _stream() -> OutputStream:
    owner = AsyncEngine(lambda: None)  # type: ignore[arg-type,return-value]  # never started
    return OutputStream(owner, "cmpl-test", ["r"])


def test_stream_takes_every_queued_step_at_once() -> None:
    async def run() -> list[list[SequenceDelta]]:
        stream = _stream()
        stream._push([_delta("r", 0, 1, "a")])
        got = []
        async for deltas in stream:
            got.append(deltas)
            if len(got) == 1:  # the consumer falls behind by three steps, the last one finishing
                stream._push([_delta("r", 0, 2, "b")])
                stream._push([_delta("r", 0, 3, "c")])
                stream._push([_delta("r", 0, 4, "d", "length")])
                stream._finish("r")  # the engine reports the request's end with its last delta
        return got

    got = asyncio.run(run())
    assert [[(d.token_ids, d.text, d.finish_reason) for d in step] for step in got] == [
        [([1], "a", None)], [([2, 3, 4], "bcd", "length")]]


def test_stream_yields_what_arrived_before_an_error() -> None:
    async def run() -> tuple[list[str], BaseException | None]:
        stream = _stream()
        stream._push([_delta("r", 0, 1, "a")])
        stream._push([_delta("r", 0, 2, "b")])
        stream._fail(EngineError("boom"))
        texts = []
        try:
            async for deltas in stream:
                texts += [d.text for d in deltas]
        except EngineError as e:
            return texts, e
        return texts, None

    texts, error = asyncio.run(run())
    assert texts == ["ab"] and str(error) == "boom"


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(demo_dir)


def test_multi_token_sse_chunks_reassemble_the_text(tokenizer: Tokenizer) -> None:
    """Completion SSE over a stream whose consumer fell behind: one chunk carries several tokens
    and their logprobs, and text, logprobs, offsets and usage equal the one-chunk-per-token run."""
    ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    texts = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    steps = [[_delta("r", 0, t, texts[i][len(texts[i - 1]) if i else 0:], "length" if i == len(ids) - 1 else None,
                     logprob=-0.5 * (i + 1))] for i, t in enumerate(ids)]

    async def sse(lag: int) -> list[dict[str, Any]]:
        """The SSE payloads when the consumer reads after every `lag` steps."""
        stream = _stream()
        events = _events(Serving(None, "m"), stream, tokenizer, {"r": 0}, 1, None, True)  # type: ignore[arg-type]
        payloads = []
        for i in range(0, len(steps), lag):
            for step in steps[i : i + lag]:
                stream._push(step)
                if step[-1].finished:
                    stream._finish("r")
            payloads.append(await anext(events))  # every delta has logprobs: exactly one chunk each
        payloads += [chunk async for chunk in events]  # the finish chunk, usage, [DONE]
        return [json.loads(p[6:]) for p in payloads if p != b"data: [DONE]\n\n"]

    one, merged = asyncio.run(sse(1)), asyncio.run(sse(4))
    for events in (one, merged):
        choices = [c for e in events for c in e["choices"]]
        assert "".join(c["text"] for c in choices) == tokenizer.decode(ids)
        tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert [x for c in choices if c["logprobs"] for x in c["logprobs"]["token_logprobs"]] == [
            -0.5 * (i + 1) for i in range(len(ids))]
        offsets = [x for c in choices if c["logprobs"] for x in c["logprobs"]["text_offset"]]
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        assert events[-1]["usage"]["completion_tokens"] == len(ids)
        assert choices[-1]["finish_reason"] == "length"
    assert len(merged) < len(one)


def test_stream_interval_sends_every_n_steps(demo_dir: Path) -> None:
    """A server with --stream-interval 4: the first token at once, then one chunk per 4 tokens
    (and the last at the end), carrying exactly the text a non-streamed request gets."""
    import httpx

    from support.server import make_engine, serve, sse_payloads

    body = {"prompt": "Once upon a time", "max_tokens": 17, "temperature": 0.0, "ignore_eos": True}
    with serve(make_engine(demo_dir), stream_interval=4) as (url, _):
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        raw = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60).content
    chunks = [p["choices"][0] for p in sse_payloads(raw) if p["choices"]]
    assert "".join(c["text"] for c in chunks) == whole
    assert chunks[-1]["finish_reason"] == "length"
    # tokens 1 | 2-5 | 6-9 | 10-13 | 14-17 (the last one ends the sequence): at most 5 text chunks
    assert 3 <= sum(bool(c["text"]) for c in chunks) <= 5
