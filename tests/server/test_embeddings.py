"""POST /v1/embeddings on a real server, driven by the openai SDK (and LangChain and LiteLLM),
against transformers' final hidden states of the same tiny checkpoint: mean pooling (no
declaration), last-token pooling (a sentence-transformers pooling config, as Qwen3-Embedding
ships), Matryoshka `dimensions`, base64, and the 400s."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from nanoserve.engine.args import EngineArgs
from nanoserve.runtime.builder import build_engine

from support.embeddings import cosine, hf_embeddings
from support.server import ENGINE_ARGS, SERVED, serve, wait_idle

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a"]
SIMILAR = 0.9999


def last_token_checkpoint(source: Path, target: Path) -> Path:
    """A copy of `source` declaring last-token pooling (sentence-transformers' files, as
    Qwen3-Embedding has them) and Matryoshka embeddings (`is_matryoshka` in config.json)."""
    shutil.copytree(source, target)
    (target / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True,
    }))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return target


def bare_decoder_checkpoint(source: Path, target: Path) -> Path:
    """`source`'s decoder saved alone, as embedding models ship (Qwen3-Embedding is a `Qwen3Model`:
    tensor names without the `model.` prefix, no LM head), declaring last-token pooling."""
    import transformers

    transformers.AutoModel.from_pretrained(source, dtype=torch.float32).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    last = last_token_checkpoint(source, target.parent / "last-source")
    for name in ("modules.json", "1_Pooling"):
        (shutil.copytree if (last / name).is_dir() else shutil.copy)(last / name, target / name)
    return target


def _served(path: Path) -> Iterator[tuple[str, Any]]:
    engine = build_engine(EngineArgs(model=str(path), dtype="float32", **ENGINE_ARGS))
    with serve(engine) as served:
        yield served


@pytest.fixture(scope="module")
def mean_ckpt(make_checkpoint: Any) -> Path:
    return make_checkpoint("qwen3")


@pytest.fixture(scope="module")
def mean_server(mean_ckpt: Path) -> Iterator[tuple[str, Any]]:
    yield from _served(mean_ckpt)


@pytest.fixture(scope="module")
def last_ckpt(mean_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return last_token_checkpoint(mean_ckpt, tmp_path_factory.mktemp("last") / "ckpt")


@pytest.fixture(scope="module")
def last_server(last_ckpt: Path) -> Iterator[tuple[str, Any]]:
    yield from _served(last_ckpt)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def token_ids(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]


def test_strings_and_token_ids_equal_transformers_mean(mean_server: tuple[str, Any], mean_ckpt: Path) -> None:
    url, app = mean_server
    ids = [token_ids(url, t) for t in TEXTS]
    refs = hf_embeddings(mean_ckpt, ids, "mean")
    out = client(url).embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == SERVED
    for d, ref in zip(out.data, refs, strict=True):
        assert len(d.embedding) == 64 and cosine(d.embedding, ref) > SIMILAR
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    one = client(url).embeddings.create(model=SERVED, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and cosine(one.data[0].embedding, refs[1]) > SIMILAR
    by_ids = client(url).embeddings.create(model=SERVED, input=ids[1], encoding_format="float")
    assert by_ids.data[0].embedding == one.data[0].embedding
    many_ids = client(url).embeddings.create(model=SERVED, input=ids, encoding_format="float")
    assert [d.embedding for d in many_ids.data] == [d.embedding for d in out.data]
    wait_idle(app)


def test_base64_decodes_to_the_floats(mean_server: tuple[str, Any]) -> None:
    url, app = mean_server
    floats = client(url).embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    decoded = client(url).embeddings.create(model=SERVED, input=TEXTS)
    raw = httpx.post(f"{url}/v1/embeddings", json={"model": SERVED, "input": TEXTS, "encoding_format": "base64"})
    assert raw.status_code == 200, raw.text
    for f, d, r in zip(floats.data, decoded.data, raw.json()["data"], strict=True):
        as_f32 = np.asarray(f.embedding, dtype=np.float32)
        assert np.array_equal(np.frombuffer(base64.b64decode(r["embedding"]), dtype="<f4"), as_f32)
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), as_f32)
    wait_idle(app)


def test_last_token_pooling_and_dimensions(last_server: tuple[str, Any], last_ckpt: Path) -> None:
    url, app = last_server
    ids = [token_ids(url, t) for t in TEXTS]
    refs = hf_embeddings(last_ckpt, ids, "last")
    out = client(url).embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
    for d, ref in zip(out.data, refs, strict=True):
        assert cosine(d.embedding, ref) > SIMILAR
    means = hf_embeddings(last_ckpt, ids, "mean")
    assert cosine(out.data[1].embedding, means[1]) < 0.99  # the declaration is what decides
    cut = client(url).embeddings.create(model=SERVED, input=TEXTS, dimensions=16, encoding_format="float")
    for d, ref in zip(cut.data, refs, strict=True):
        assert len(d.embedding) == 16
        assert cosine(d.embedding, torch.nn.functional.normalize(ref[:16], dim=0)) > SIMILAR
        assert abs(float(np.linalg.norm(d.embedding)) - 1) < 1e-5
    too_many = httpx.post(f"{url}/v1/embeddings", json={"input": "a", "dimensions": 65})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "dimensions"
    wait_idle(app)


def test_a_bare_decoder_checkpoint(last_ckpt: Path, mean_ckpt: Path, tmp_path: Path) -> None:
    path = bare_decoder_checkpoint(mean_ckpt, tmp_path / "bare")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(k.startswith("model.") for k in names)
    served = _served(path)
    url, app = next(served)
    try:
        ids = [token_ids(url, t) for t in TEXTS]
        refs = hf_embeddings(last_ckpt, ids, "last")
        out = client(url).embeddings.create(model=SERVED, input=TEXTS, encoding_format="float")
        assert all(cosine(d.embedding, ref) > SIMILAR for d, ref in zip(out.data, refs, strict=True))
        wait_idle(app)
    finally:
        served.close()


def test_an_engine_core_process_beside_generation(last_ckpt: Path) -> None:
    """The core in its own process (the vectors cross the pipe), embeddings requested while
    completions stream: each vector is transformers'."""
    from nanoserve.server import ServerConfig, build_app
    from nanoserve.server.http_server import ServerThread

    app = build_app(EngineArgs(model=str(last_ckpt), dtype="float32", max_num_batched_tokens=16, **ENGINE_ARGS),
                    ServerConfig(served_model_name=SERVED))
    with ServerThread(app) as server:
        server.wait_healthy(timeout=120)
        url = server.url
        ids = [token_ids(url, t) for t in TEXTS]
        refs = hf_embeddings(last_ckpt, ids, "last")
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        async def generate(i: int) -> int:
            stream = await aclient.completions.create(model=SERVED, prompt=TEXTS[i % 3], max_tokens=24,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            return len([c async for c in stream])

        async def embed(i: int) -> list[float]:
            out = await aclient.embeddings.create(model=SERVED, input=TEXTS[i % 3], encoding_format="float")
            return out.data[0].embedding

        async def both() -> tuple[list[int], list[list[float]]]:
            streams = [asyncio.ensure_future(generate(i)) for i in range(3)]
            await asyncio.sleep(0.05)
            vectors = await asyncio.gather(*(embed(i) for i in range(6)))
            return list(await asyncio.gather(*streams)), list(vectors)

        chunks, vectors = asyncio.run(both())
        assert all(n > 0 for n in chunks)
        assert all(cosine(v, refs[i % 3]) > SIMILAR for i, v in enumerate(vectors))
        wait_idle(app)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1, 10**6]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "word " * 200}, "input"),
    ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": "a", "model": "other"}, "model"),
    ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(mean_server: tuple[str, Any], body: dict[str, Any],
                                             param: str) -> None:
    url, app = mean_server
    r = httpx.post(f"{url}/v1/embeddings", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    assert httpx.post(f"{url}/v1/embeddings", json={"input": "still up"}).status_code == 200
    wait_idle(app)


def test_too_long_names_the_limit(mean_server: tuple[str, Any]) -> None:
    url, _ = mean_server
    r = httpx.post(f"{url}/v1/embeddings", json={"input": list(range(1, 130))})
    assert r.status_code == 400
    assert "maximum context length is 128 tokens; the request asks for 129 in the input" in r.json()["error"]["message"]


def test_langchain_openai_embeddings(mean_server: tuple[str, Any], mean_ckpt: Path) -> None:
    """LangChain's client tokenizes with tiktoken unless `check_embedding_ctx_length=False` (its
    encodings are downloaded, so offline it must be off): then it sends the texts as they are."""
    langchain_openai = pytest.importorskip("langchain_openai")
    url, app = mean_server
    embeddings = langchain_openai.OpenAIEmbeddings(model=SERVED, base_url=f"{url}/v1", api_key="unused",
                                                   check_embedding_ctx_length=False, max_retries=0)
    refs = hf_embeddings(mean_ckpt, [token_ids(url, t) for t in TEXTS], "mean")
    docs = embeddings.embed_documents(TEXTS)
    assert len(docs) == 3 and all(cosine(v, ref) > SIMILAR for v, ref in zip(docs, refs, strict=True))
    assert cosine(embeddings.embed_query(TEXTS[0]), refs[0]) > SIMILAR
    wait_idle(app)


def test_litellm_embedding(mean_server: tuple[str, Any], mean_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LiteLLM as an OpenAI-compatible provider (`openai/<name>` with an api_base); its model cost
    map is read from the package (`LITELLM_LOCAL_MODEL_COST_MAP`), not fetched."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    url, app = mean_server
    refs = hf_embeddings(mean_ckpt, [token_ids(url, t) for t in TEXTS], "mean")
    out = litellm.embedding(model=f"openai/{SERVED}", input=TEXTS, api_base=f"{url}/v1", api_key="unused")
    vectors = [d["embedding"] for d in out.data]
    assert all(cosine(v, ref) > SIMILAR for v, ref in zip(vectors, refs, strict=True))
    assert out.usage.prompt_tokens == sum(len(token_ids(url, t)) for t in TEXTS)
    wait_idle(app)
