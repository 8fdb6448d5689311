"""Request fields beyond the basic sampling ones: logit_bias, allowed_token_ids, bad_words,
include_stop_str_in_output, prompt_logprobs, the model's generation-config defaults; and on the
server, the documented no-op fields, the refused ones, unknown fields (and --ignore-unknown-fields),
CORS, SSE keep-alive, the documented request bodies (/openapi.json) and a schemathesis run over
them; the metrics' model_name label and /favicon.ico."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi import FastAPI

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampler import Sampler, SamplingBatch
from nanoserve.model import load_model

from support.forward import full_logits
from support.server import ENGINE_ARGS, SERVED, make_engine, metric_value, serve, sse_payloads, wait_idle

V = 50


def _batch(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatch:
    outputs = outputs or [[] for _ in params]
    return SamplingBatch.build(params, outputs, [[1] for _ in params], [None] * len(params), V, torch.device("cpu"),
                               [frozenset()] * len(params))


# ---- the sampler's token-constraint step ----

def test_constraints_touch_only_their_rows_and_bind_greedy_and_sampled_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    plain = SamplingParams(temperature=0.0)
    free_argmax = logits.argmax(dim=-1).tolist()
    biased = SamplingParams(temperature=0.0, logit_bias={7: 100.0, int(free_argmax[1]): -100.0})
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[3, 11])
    out = Sampler()(logits, _batch([plain, biased, allowed, plain]))
    assert out.token_ids[0] == free_argmax[0] and out.token_ids[3] == free_argmax[3]
    assert out.token_ids[1] == 7
    assert out.token_ids[2] in (3, 11)
    for _ in range(20):  # every draw of a restricted row stays in its set
        assert Sampler()(logits, _batch([allowed])).token_ids[0] in (3, 11)


def test_bad_words_ban_the_last_token_only_after_its_prefix() -> None:
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0  # the greedy choice, and the end of the bad word [4, 9]
    logits[0, 8] = 4.0
    p = SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[4, 9], [20]])
    assert Sampler()(logits, _batch([p], [[1, 2]])).token_ids == [9]  # the prefix [4] is not the tail
    assert Sampler()(logits, _batch([p], [[1, 4]])).token_ids == [8]
    logits[0, 20] = 9.0
    assert Sampler()(logits, _batch([p], [[1, 4]])).token_ids == [8]  # a one-token bad word: always banned


def test_raw_logprobs_stay_raw_under_a_bias() -> None:
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=0.0, logit_bias={5: 50.0}, logprobs=0)
    out = Sampler()(logits, _batch([p]))
    assert out.token_ids == [5]
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 5].item(), abs=1e-6)


# ---- the engine, offline ----

@pytest.fixture(scope="module")
def llm(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), **ENGINE_ARGS)


def _greedy(llm: LLM, prompt: str, **fields: Any) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=fields.pop("max_tokens", 16), ignore_eos=True, **fields)
    return llm.generate(prompt, params)[0].outputs[0]


def test_logit_bias_and_allowed_token_ids_offline(llm: LLM) -> None:
    assert set(_greedy(llm, "Once upon", logit_bias={42: 100.0}).token_ids) == {42}
    sampled = llm.generate("Once upon", SamplingParams(max_tokens=24, ignore_eos=True, seed=3,
                                                       allowed_token_ids=[40, 41, 42]))[0].outputs[0]
    assert set(sampled.token_ids) <= {40, 41, 42}


def test_constrained_rows_are_not_drafted_for(demo_dir: Path, llm: LLM) -> None:
    """Speculative decoding stays exact: rows with token constraints get no drafts (verification
    does not apply them), and come out as without speculation, beside rows that are drafted for."""
    spec = LLM(str(demo_dir), speculative_method="ngram", **ENGINE_ARGS)
    constrained = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={42: 8.0},
                                 bad_words=["the"])
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["the cat and the cat and the cat and the", "the cat and the cat and the cat and the"]
    alone = spec.generate(prompts[0], constrained)[0].outputs[0].token_ids
    assert spec.engine.spec_stats.proposed == 0
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, [constrained, free])]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, [constrained, free])]
    assert got == want and got[0] == alone
    assert spec.engine.spec_stats.proposed > 0  # the free row was drafted for


def test_bad_words_are_never_generated(llm: LLM) -> None:
    assert llm.tokenizer is not None
    free = _greedy(llm, "The quick brown fox", max_tokens=24)
    word = next(w for w in free.text.split() if len(w) > 2)
    out = _greedy(llm, "The quick brown fox", max_tokens=24, bad_words=[word])
    banned = [llm.tokenizer.encode(f, add_special_tokens=False) for f in (word, " " + word)]
    ids = out.token_ids
    for seq in banned:
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids))), (word, seq)
    assert out.token_ids != free.token_ids


def test_include_stop_str_in_output(llm: LLM) -> None:
    free = _greedy(llm, "Hello there", max_tokens=24)
    stop = free.text[5:8]
    assert stop.strip() and stop in free.text
    cut = _greedy(llm, "Hello there", max_tokens=24, stop=[stop])
    kept = _greedy(llm, "Hello there", max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"


def test_prompt_logprobs_match_the_model_and_ignore_the_prefix_cache(demo_dir: Path) -> None:
    loaded = load_model(demo_dir, dtype="float32")
    llm = LLM(loaded=loaded, **{**ENGINE_ARGS, "max_num_batched_tokens": 7})  # the prompt in chunks
    assert llm.tokenizer is not None
    prompt = "The quick brown fox jumps over the lazy dog, and then the fox runs."
    ids = llm.tokenizer.encode(prompt)
    reference = torch.log_softmax(full_logits(loaded, [ids])[0].float(), dim=-1)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2)
    warm = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))[0]  # fills the prefix cache
    out = llm.generate(prompt, params)[0]
    assert warm.prompt_logprobs is None
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    for p, e in enumerate(entries[1:]):
        assert e is not None and e.token_id == ids[p + 1]
        assert e.logprob == pytest.approx(reference[p, ids[p + 1]].item(), abs=1e-4)
        rank = int((reference[p] > reference[p, ids[p + 1]]).sum()) + 1
        assert abs(e.rank - rank) <= rank // 100  # deep in the tail, rounding may swap neighbours
        assert [t for t, _ in e.top] == reference[p].topk(3).indices.tolist()
    assert [o.token_ids for o in out.outputs] == [warm.outputs[0].token_ids] * 2


def test_generation_config_defaults(tmp_path: Path, make_checkpoint: Any) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("qwen3"), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "do_sample": True, "eos_token_id": 1}))
    auto = LLM(str(ckpt), **ENGINE_ARGS)
    assert auto.engine.sampling_defaults == {"temperature": 0.0, "top_k": 20, "top_p": 0.95}
    default = auto.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p) == (0.0, 20, 0.95)
    a, b = auto.generate(["Hi", "Hi"])  # greedy by the model's default: equal
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    own = LLM(str(ckpt), generation_config="vllm", **ENGINE_ARGS)
    assert own.engine.sampling_defaults == {}
    assert own.get_default_sampling_params() == SamplingParams()


# ---- the server ----

@pytest.fixture(scope="module")
def server(engine: LLMEngine) -> Iterator[tuple[str, FastAPI]]:
    engine.sampling_defaults = {"temperature": 0.0}  # as a generation_config.json would set them
    with serve(engine, allowed_origins=("https://app.example",), sse_keep_alive_s=0.2) as served:
        yield served


@pytest.fixture
def url(server: tuple[str, FastAPI]) -> Iterator[str]:
    yield server[0]
    wait_idle(server[1])


def test_fields_through_the_sdk(url: str, llm: LLM) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=SERVED, prompt="Once upon", max_tokens=6, logit_bias={"42": 100},
                                    extra_body={"ignore_eos": True})
    assert llm.tokenizer is not None
    assert out.choices[0].text == llm.tokenizer.decode([42] * 6)
    free = client.completions.create(model=SERVED, prompt="Hello there", max_tokens=24,
                                     extra_body={"ignore_eos": True})  # greedy: the served default
    assert free.choices[0].text == _greedy(llm, "Hello there", max_tokens=24).text
    stop = free.choices[0].text[5:8]
    kept = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=24,
                                          stop=[stop], extra_body={"include_stop_str_in_output": True,
                                                                   "allowed_token_ids": list(range(30, 200))})
    text = kept.choices[0].message.content or ""
    assert kept.choices[0].finish_reason != "stop" or text.endswith(stop)


def test_prompt_logprobs_in_completions(url: str, llm: LLM) -> None:
    body = {"model": SERVED, "prompt": ["The lazy dog", "A fox"], "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    offline = llm.generate("The lazy dog", SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    assert offline.prompt_logprobs is not None
    choices = r.json()["choices"]
    assert len(choices) == 4 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    served = choices[0]["prompt_logprobs"]
    assert served[0] is None and len(served) == len(offline.prompt_logprobs)
    for got, want in zip(served[1:], offline.prompt_logprobs[1:], strict=True):
        assert want is not None
        assert got[str(want.token_id)]["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        assert got[str(want.token_id)]["rank"] == want.rank
        assert len(got) in (2, 3)  # the top 2, and the prompt token when it is not among them
    assert choices[2]["prompt_logprobs"] != served


def test_keep_alive_comments_on_a_silent_stream(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    step = engine.step

    def slow_step() -> Any:
        time.sleep(0.5)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": SERVED, "prompt": "tick", "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        raw = r.read()
    assert b": keep-alive\n\n" in raw
    payloads = sse_payloads(raw.replace(b": keep-alive\n\n", b""))
    assert "".join(p["choices"][0]["text"] for p in payloads)


def test_cors(url: str, engine: LLMEngine) -> None:
    preflight = httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    with serve(engine) as (plain_url, _):  # off by default
        r = httpx.get(f"{plain_url}/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_openapi_documents_every_request_body(url: str) -> None:
    spec = httpx.get(f"{url}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"),
                        ("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest"),
                        ("/v1/embeddings", "EmbeddingRequest"), ("/v1/responses", "ResponsesRequest")):
        post = spec["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "400" in post["responses"]
    for field in ("logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "prompt_logprobs"):
        assert field in schemas["CompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    anthropic_error = spec["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]
    assert anthropic_error["schema"] == {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    assert {"max_tokens", "messages", "model"} <= set(schemas["MessagesRequest"]["required"])


# ---- every field of the current request bodies ----

NO_OP_CHAT_FIELDS: dict[str, Any] = {
    "service_tier": "auto", "prompt_cache_key": "user-42", "safety_identifier": "hashed-id", "user": "u",
    "verbosity": "low", "modalities": ["text"], "metadata": {"k": "v"}, "store": False, "reasoning_effort": "high",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
}


def test_no_op_fields_change_nothing(url: str) -> None:
    """The fields OpenAI's SDK sends that cannot change this model's output are accepted and leave
    it as it is (the demo template reads neither `verbosity` nor the thinking switches)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    base: dict[str, Any] = dict(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                temperature=0.0)
    plain = client.chat.completions.create(**base)
    given = client.chat.completions.create(**base, **NO_OP_CHAT_FIELDS)
    assert given.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(**base, **NO_OP_CHAT_FIELDS, stream=True,
                                                 stream_options={"include_usage": True, "include_obfuscation": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage is not None


@pytest.mark.parametrize(("field", "value"), [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("moderation", {"model": "omni-moderation-latest"}), ("store", True), ("use_beam_search", True),
])
def test_fields_that_would_change_the_output_are_refused(url: str, field: str, value: Any) -> None:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").status_code == 200


def test_unknown_fields(url: str, engine: LLMEngine, caplog: pytest.LogCaptureFixture) -> None:
    """A name no API defines is a 400 by default; `--ignore-unknown-fields` logs and drops it, and
    still refuses the fields the APIs define that nanoserve cannot honour."""
    body: dict[str, Any] = {"model": SERVED, "prompt": "Once upon", "max_tokens": 3, "temperature": 0.0,
                            "frobnicate": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    want = httpx.post(f"{url}/v1/completions", json={k: v for k, v in body.items() if k != "frobnicate"}, timeout=60)
    with serve(engine, ignore_unknown_fields=True) as (lenient, app), caplog.at_level("WARNING"):
        r = httpx.post(f"{lenient}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        assert any("frobnicate" in rec.getMessage() for rec in caplog.records)
        chat = {"model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "audio": {"voice": "alloy"}}
        r = httpx.post(f"{lenient}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "audio"
        wait_idle(app)
    assert httpx.get(f"{url}/health").status_code == 200


def test_metrics_carry_the_model_name(url: str) -> None:
    httpx.post(f"{url}/v1/completions", json={"model": SERVED, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    page = httpx.get(f"{url}/metrics").text
    samples = [line for line in page.splitlines() if line.startswith("nanoserve:")]
    assert len(samples) > 20
    assert all(f'model_name="{SERVED}"' in line for line in samples), [s for s in samples if SERVED not in s]
    finished = f'nanoserve:request_finished_total{{model_name="{SERVED}",finished_reason="length"}}'
    assert metric_value(page, finished) >= 1


def test_favicon_is_no_content(url: str) -> None:
    r = httpx.get(f"{url}/favicon.ico")
    assert r.status_code == 204 and not r.content


def test_effort_fields_reach_a_template_that_reads_them(demo_dir: Path, tmp_path: Path) -> None:
    """A template with its own `reasoning_effort` and `verbosity` variables (gpt-oss's shape)
    renders them: the prompt grows by the words they add, and by nothing without them."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_dir, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
        "{%- if verbosity is defined %}Verbosity: {{ verbosity }}\n{% endif %}"
        "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    with serve(make_engine(ckpt)) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        tok = app.state.engine.info.tokenizer

        def prompt_tokens(**fields: Any) -> int:
            r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=1, **fields)
            assert r.usage is not None
            return r.usage.prompt_tokens

        plain = prompt_tokens()
        assert plain == len(tok.encode("user: Hi\nassistant:"))
        assert prompt_tokens(reasoning_effort="high", verbosity="low") == len(
            tok.encode("Reasoning: high\nVerbosity: low\nuser: Hi\nassistant:"))
        wait_idle(app)
