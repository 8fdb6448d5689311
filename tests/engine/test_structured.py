"""Structured output: constrained decoding through llguidance, in the engine and over HTTP.

Every output that finishes with "stop" must parse and validate (jsonschema) against its schema;
the demo model's random weights make the grammar, not the model, responsible for that. Strings
and arrays in the schemas are bounded so that outputs end well within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from fastapi import FastAPI

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import StructuredOutputs
from nanoserve.engine.structured import GrammarCompiler, json_schema_source
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.serving import GrammarGate
from nanoserve.tokenizer import Tokenizer

from support.server import SERVED, hold_after_first_output, sse_payloads, wait_idle

NAME = {"type": "string", "maxLength": 8}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
                 "required": ["name", "admin"], "additionalProperties": False},
        "note": {"type": "null"}}, "required": ["user", "note"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "mode": {"const": "fast"}}, "required": ["tags", "mode"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.25}},
        "required": ["age", "score"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
                "required": ["code"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, NAME,
                         {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                                "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                                "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"], "additionalProperties": False},
}
PROMPTS = ["Describe a person as JSON:", "hello", "The weather today"]


@pytest.fixture(scope="module")
def llm(demo_dir: Path) -> LLM:
    return LLM(str(demo_dir), max_model_len=256, num_kv_blocks=96)


def _json(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=96, structured=StructuredOutputs(json=schema), **kw)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schemas_greedy_and_sampled(llm: LLM, name: str) -> None:
    """One batch per schema: greedy and three seeds, over several prompts; every output that
    stops validates, and most stop (a JSON number may go on with digits until max_tokens, which
    is a "length" finish: the one way a constrained output is not complete)."""
    schema = SCHEMAS[name]
    settings = [{"temperature": 0.0}, *({"temperature": 1.0, "seed": s} for s in range(3))]
    outs = llm.generate([p for p in PROMPTS for _ in settings], [_json(schema, **s) for _ in PROMPTS for s in settings])
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(finished) * 2 > len(outs)
    for c in finished:
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.num_live_grammars == 0


def test_json_object_choice_regex_grammar(llm: LLM) -> None:
    gbnf = 'root ::= "yes" | "no" | ("maybe " [0-9])'
    lark = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'
    specs = [StructuredOutputs(choice=["alpha", "beta", "gamma ray"]),
             StructuredOutputs(regex=r"[a-c]{2}-\d{2}"), StructuredOutputs(grammar=lark),
             StructuredOutputs(grammar=gbnf)]
    outs = llm.generate(["a"] * len(specs),
                        [SamplingParams(max_tokens=48, temperature=1.0, seed=7, structured=s) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert texts[0] in ("alpha", "beta", "gamma ray")
    assert re.fullmatch(r"[a-c]{2}-\d{2}", texts[1])
    assert re.fullmatch(r"x=[0-9]{1,3};", texts[2])
    assert re.fullmatch(r"yes|no|maybe [0-9]", texts[3])


def test_json_object(llm: LLM) -> None:
    """Any JSON object; its strings are unbounded (the demo model writes long keys), so only the
    outputs that stop must parse."""
    outs = llm.generate(["a"] * 4, [SamplingParams(max_tokens=64, temperature=1.0, seed=s,
                                                   structured=StructuredOutputs(json_object=True)) for s in range(4)])
    assert all(o.outputs[0].text.startswith("{") for o in outs)
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert all(isinstance(json.loads(t), dict) for t in stopped)


def test_constrained_beside_unconstrained(llm: LLM) -> None:
    """A constrained row changes nothing for the unconstrained rows of its batch."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    solo = llm.generate(["Once upon a time", "The cat"], [free, sampled])
    mixed = llm.generate(["Once upon a time", "The cat", "Give JSON:"],
                         [free, sampled, _json(SCHEMAS["nested"], temperature=0.0)])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in solo]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS["nested"])


def test_with_speculative_decoding(demo_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """n-gram drafting on: constrained sequences get no drafts (logged once) and still validate;
    an unconstrained one beside them is still drafted for."""
    llm = LLM(str(demo_dir), max_model_len=256, num_kv_blocks=96, speculative_method="ngram")
    schema = SCHEMAS["ref"]
    with caplog.at_level("INFO", logger="nanoserve.engine.llm_engine"):
        outs = llm.generate(["a b a b a b a b", "Give JSON:", "x"],
                            [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                             _json(schema, temperature=0.0), _json(schema, temperature=1.0, seed=3)])
    for out in outs[1:]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert llm.engine.spec_stats.proposed > 0
    assert sum("get no drafts" in r.message for r in caplog.records) == 1


def test_after_preemption(demo_dir: Path, llm: LLM) -> None:
    """A pool too small for the batch preempts; recomputed sequences keep their grammar state and
    finish exactly as they do alone."""
    schema = SCHEMAS["nested"]
    prompts = [f"Person number {i} is" for i in range(6)]
    params = [_json(schema, temperature=0.0), _json(schema, temperature=1.0, seed=5)] * 3
    small = LLM(str(demo_dir), max_model_len=128, num_kv_blocks=14, block_size=8)
    outs = small.generate(prompts, params)
    assert small.engine.num_preemptions > 0
    alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params, strict=True)]
    for out, ref in zip(outs, alone, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert small.engine.num_live_grammars == 0 and small.engine.kv_stats().blocks_used == 0


def test_abort_frees_the_matchers(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("r", engine.tokenizer.encode("hi"), _json(SCHEMAS["ref"], n=3, temperature=1.0))  # type: ignore[union-attr]
    engine.step()
    engine.step()
    assert engine.num_live_grammars == 3
    assert engine.abort("r")
    assert engine.num_live_grammars == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(("spec", "message"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"json": {"$ref": "#"}}, "json"),  # refers to itself and to nothing else: no value satisfies it
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "json"),
])
def test_bad_constraints_do_not_compile(llm: LLM, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"the {message} constraint does not compile"):
        llm.generate("a", SamplingParams(structured=StructuredOutputs(**spec)))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"child": {"$ref": "#"}}},  # {} ends the recursion
    {"type": "array", "items": {"$ref": "#"}},  # so does []
])
def test_recursive_schemas_that_admit_a_value_compile(llm: LLM, schema: dict[str, Any]) -> None:
    assert llm.engine.grammars is not None
    llm.engine.grammars.compile(StructuredOutputs(json=schema))


@pytest.mark.parametrize("fields", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"json": "[1"}])
def test_exactly_one_well_formed_constraint(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        StructuredOutputs(**fields)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredOutputs(regex="a+"))


def test_a_slow_compile_is_refused(demo_dir: Path) -> None:
    """The front end's compile has a time limit: past it the request is a 400 naming the field."""
    tok = Tokenizer.from_pretrained_dir(demo_dir)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i}}}x[0-9]+$"}
                                            for i in range(300)}}
    gate = GrammarGate(timeout_s=1e-4)
    with pytest.raises(APIError) as e:
        asyncio.run(gate.check(tok, SamplingParams(structured=StructuredOutputs(json=big)), "response_format"))
    assert e.value.status == 400 and "did not compile within" in e.value.message
    assert e.value.param == "response_format"


def _slow_grammar(num_properties: int) -> str:
    """A Lark grammar that takes long to compile (an embedded object schema of many optional
    properties, whose compile grows faster than linearly) behind a branch that greedy decoding of
    the demo model never takes: its greedy output is `{"ok": true}`."""
    big = json_schema_source({"type": "object", "properties": {f"p{i}": {"type": "boolean"}
                                                                for i in range(num_properties)}})
    return f'start: "{{\\"ok\\": true}}" | big\nbig: "#" %json {json.dumps(big)}\n'


OK_SCHEMA = {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"], "additionalProperties": False}


def test_a_slow_compile_does_not_stall_other_requests(demo_dir: Path) -> None:
    """The engine compiles on the compiler's threads: while a constraint that takes a long time
    to compile (measured here first) compiles, an unconstrained request keeps getting a token
    every step, and no step (nor add_request) takes more than a fraction of that compile; the
    constrained request then runs and validates."""
    spec = StructuredOutputs(grammar=_slow_grammar(3000))
    engine = LLM(str(demo_dir), max_model_len=256, num_kv_blocks=96).engine
    assert engine.tokenizer is not None
    start = time.perf_counter()
    GrammarCompiler(engine.tokenizer).compile(spec)  # another compiler: the engine's cache stays cold
    compile_s = time.perf_counter() - start
    assert compile_s > 0.2, "the grammar should be slow to compile"
    ids = engine.tokenizer.encode("Give JSON:")
    engine.add_request("free", ids, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    engine.add_request("slow", ids, SamplingParams(max_tokens=16, temperature=0.0, structured=spec))
    gaps, free_steps, text, finish = [time.perf_counter() - start], [], "", None
    while not engine.started("slow"):
        time.sleep(0.002)  # the rest of a serving loop's iteration
        start = time.perf_counter()
        out = engine.step()
        gaps.append(time.perf_counter() - start)
        free = [d for d in out.deltas if d.request_id == "free"]
        free_steps.append(len(free[0].token_ids) if free else 0)
        for d in out.deltas:
            if d.request_id == "slow":
                text, finish = text + d.text, d.finish_reason
    while free_steps and not free_steps[-1]:  # steps after the free request ended
        free_steps.pop()
    assert len(free_steps) >= 10 and all(free_steps[:-1])  # while the grammar compiled, "free" ran every step
    assert max(gaps) < compile_s / 3, (max(gaps), compile_s)
    while finish is None:
        for d in engine.step().deltas:
            if d.request_id == "slow":
                text, finish = text + d.text, d.finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), OK_SCHEMA)
    engine.abort("free")
    assert engine.num_live_grammars == 0 and not engine.has_unfinished()


def test_abort_and_failure_while_compiling(demo_dir: Path) -> None:
    """A request aborted while its constraint compiles holds nothing; one whose constraint does
    not compile fails alone (in a later step's `failed`), beside a request that runs on."""
    engine = LLM(str(demo_dir), max_model_len=256, num_kv_blocks=96).engine
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode("hi")
    engine.add_request("slow", ids, SamplingParams(max_tokens=8, structured=StructuredOutputs(
        grammar=_slow_grammar(2000))))
    assert engine.has_unfinished() and engine.snapshot().num_waiting == 1
    assert engine.abort("slow")
    assert not engine.has_unfinished() and engine.num_live_grammars == 0
    engine.add_request("free", ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    bad = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "strng"}}})
    engine.add_request("bad", ids, SamplingParams(max_tokens=8, structured=bad))
    failed: dict[str, str] = {}
    free_tokens = 0
    while engine.has_unfinished():
        out = engine.step()
        failed |= out.failed
        free_tokens += sum(len(d.token_ids) for d in out.deltas)
        assert "bad" not in out.finished
    assert list(failed) == ["bad"] and "the json constraint does not compile" in failed["bad"]
    assert free_tokens == 40 and not engine.abort("bad")
    assert engine.num_live_grammars == 0 and engine.kv_stats().blocks_used == 0


# ---- over HTTP ----

class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture
def url(server: tuple[str, FastAPI], engine: LLMEngine) -> Iterator[str]:
    yield server[0]
    wait_idle(server[1])
    assert engine.num_live_grammars == 0


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


MESSAGES: list[Any] = [{"role": "user", "content": "Who is Ada?"}]


def test_chat_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The openai SDK's `parse` sends a strict json_schema response_format and parses the answer."""
    for seed in range(3):
        r = client.chat.completions.parse(model=SERVED, messages=MESSAGES, response_format=Person, seed=seed,
                                          max_tokens=64)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person)


def test_chat_json_object_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=SERVED, messages=MESSAGES, response_format={"type": "json_object"},
                                            stream=True, max_tokens=96, seed=1)
    text, finish = "", None
    for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text.startswith("{")
    assert finish == "length" or isinstance(json.loads(text), dict)  # unbounded strings (see test_json_object)


@pytest.mark.parametrize(("field", "value", "check"), [
    ("guided_json", SCHEMAS["numbers"], lambda t: jsonschema.validate(json.loads(t), SCHEMAS["numbers"])),
    ("guided_regex", r"\d{3}", lambda t: re.fullmatch(r"\d{3}", t)),
    ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("guided_grammar", 'root ::= "a" [b-d]', lambda t: re.fullmatch("a[b-d]", t)),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
])
def test_completion_guided_fields(client: openai.OpenAI, field: str, value: Any, check: Any) -> None:
    out = client.completions.create(model=SERVED, prompt="x", max_tokens=48, temperature=1.0, seed=2,
                                    extra_body={field: value})
    assert out.choices[0].finish_reason == "stop"
    assert check(out.choices[0].text) is not False


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_regex": "(", "stream": True}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
    ({"guided_json": {"$ref": "#"}}, "guided_json"),
])
def test_bad_constraints_are_400_before_any_stream(url: str, body: dict[str, Any], param: str) -> None:
    for path, base in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "x"})):
        r = httpx.post(f"{url}/v1/{path}", json={**base, "stream": True, **body})
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["param"] == param


def test_abort_mid_stream_frees_the_matcher(url: str, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    release = hold_after_first_output(engine, monkeypatch)
    body = {"prompt": "x", "max_tokens": 100, "stream": True, "guided_regex": "[a-z ]+", "seed": 1}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
            # one chunk in: the request runs with its matcher; closing the stream aborts it
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"], first
            assert not release.expired, "the engine was let go by the hold's timeout before the test looked"
            assert engine.num_live_grammars == 1, (first, engine.snapshot())
    finally:
        release.set()
    # the `url` fixture waits for the engine to be idle and checks that no matcher is left


def test_streamed_equals_non_streamed(url: str) -> None:
    body = {"messages": MESSAGES, "max_tokens": 96, "temperature": 0.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["array_enum"]}}}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    raw = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}).content
    streamed = "".join(p["choices"][0]["delta"].get("content") or "" for p in sse_payloads(raw)
                       if isinstance(p, dict) and p.get("choices"))
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMAS["array_enum"])


@pytest.mark.parametrize("parallel", [False, True])
def test_parallel_tool_calls_in_the_grammar(demo_dir: Path, parallel: bool) -> None:
    """parallel_tool_calls false: the forced-call grammar takes exactly one call; true: several."""
    from nanoserve.server.chat.forced_tools import forced_tool_calls
    from nanoserve.server.chat.tool_parsers.hermes import HermesParser
    from nanoserve.server.protocol.openai import FunctionDefinition

    tok = Tokenizer.from_pretrained_dir(demo_dir)
    spec = forced_tool_calls(HermesParser, [FunctionDefinition(name="f")], parallel, tok)
    matcher = GrammarCompiler(tok).compile(spec).deep_copy()
    one = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tok.encode(one + "\n" + one, add_special_tokens=False)
    assert (matcher.try_consume_tokens(ids) == len(ids)) is parallel
