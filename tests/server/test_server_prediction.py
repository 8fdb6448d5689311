"""`prediction` (OpenAI's Predicted Outputs) over HTTP with the openai SDK: the answer equals the
one without it, usage counts the accepted and rejected prediction tokens, a malformed prediction
is a 400 naming `prediction`, and the engine is left idle with every block free."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from support.server import SERVED, sse_payloads, wait_idle

QUESTION = [{"role": "user", "content": "Write a short story about a cat."}]


@pytest.fixture(scope="module")
def client(server: tuple[str, FastAPI]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=SERVED, messages=QUESTION, temperature=0, max_tokens=48,
                                          **extra)


def test_chat_with_a_prediction_answers_the_same(client: openai.OpenAI, server: tuple[str, FastAPI]) -> None:
    plain = _chat(client)
    text = plain.choices[0].message.content
    assert text and plain.usage.completion_tokens == 48
    details = plain.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0

    right = _chat(client, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    assert right.usage.completion_tokens == 48
    assert right.usage.completion_tokens_details.accepted_prediction_tokens > 24

    # An edit in the middle: the same answer, drafts accepted before and after it.
    words = text.split(" ")
    words[len(words) // 2] = "zebra"
    edited = _chat(client, prediction={"type": "content", "content": [{"type": "text", "text": " ".join(words)}]})
    assert edited.choices[0].message.content == text
    assert edited.usage.completion_tokens_details.accepted_prediction_tokens > 16

    stream = client.chat.completions.create(model=SERVED, messages=QUESTION, temperature=0, max_tokens=48, stream=True,
                                            stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": text})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 24
    wait_idle(server[1])


def test_completion_with_a_prediction_answers_the_same(client: openai.OpenAI, server: tuple[str, FastAPI]) -> None:
    args: dict[str, Any] = dict(model=SERVED, prompt="The capital of France is", temperature=0, max_tokens=32)
    # The demo model goes on into chat-template special tokens: kept in the text, so that the
    # text tokenizes back to the tokens it came from.
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    plain = client.completions.create(**args, extra_body=extra)
    text = plain.choices[0].text
    assert plain.usage.completion_tokens == 32  # type: ignore[union-attr]

    def predicted(content: str) -> Any:
        return client.completions.create(**args, extra_body={**extra,
                                                             "prediction": {"type": "content", "content": content}})

    assert predicted(text[::-1]).choices[0].text == text
    right = predicted(text)
    assert right.choices[0].text == text
    assert right.usage.completion_tokens_details.accepted_prediction_tokens > 16  # type: ignore[union-attr]
    wait_idle(server[1])


@pytest.mark.parametrize("prediction", [
    {"type": "text", "content": "x"},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"type": "content", "content": 5},
    {"type": "content"},
    "just text",
])
def test_a_malformed_prediction_is_a_400_naming_it(server: tuple[str, FastAPI], prediction: Any) -> None:
    url = server[0]
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(url + path, json={"model": SERVED, **body, "max_tokens": 4, "prediction": prediction})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].split(".")[0] == "prediction", error
    assert httpx.get(url + "/health").status_code == 200
    wait_idle(server[1])


def test_streamed_chat_usage_without_a_prediction_has_zero_details(server: tuple[str, FastAPI]) -> None:
    r = httpx.post(server[0] + "/v1/chat/completions",
                   json={"model": SERVED, "messages": QUESTION, "max_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}})
    usage = [p for p in sse_payloads(r.content) if isinstance(p, dict) and p.get("usage")][-1]["usage"]
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
