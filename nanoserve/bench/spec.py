"""Speculative decoding benchmark: the same greedy requests with speculation off and on, side by
side in one process, at several batch sizes.

Workloads:
- `chat`: short questions in the demo corpus's style, through the chat template;
- `repeat`: prompts that quote a passage and ask for it again, so the answer copies the prompt
  (the case prompt lookup is made for);
- `edit`: Predicted Outputs. Prompts that ask for small edits to a code file of ~400 tokens; the
  baseline runs them plainly, the other run with a `prediction` (its drafts, and the server's
  speculation, if any, where it has none). The prediction differs from the answer by a few small
  edits: it is the model's own greedy answer with five edits (three tokens replaced by two,
  spread over it), since the demo model cannot edit code; with a model that can, the original
  file is such a prediction of the edited one. Acceptance and speed depend only on that relation;
- `edit-file`: the same prompts, predicted by the file they quote (what a client sends): the
  demo model's answer does not follow it, so this measures what a wrong prediction costs.

The plain and the speculative engine run the same requests interleaved, a step of one then a step
of the other, each step timed: on a shared machine the speed of one core moves by tens of percent
from one second to the next, and run one after the other, the two engines would meet different
moments of it.

Reported per batch size: output tok/s without and with speculation (medians over rounds), the
speed-up (the median, and the range, of each round's ratio), the draft acceptance rate and the
mean tokens per verification (accepted drafts + 1).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

from nanoserve.bench.throughput import format_table
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.engine.spec_decode import SpecStats
from nanoserve.model import LoadedModel, load_model
from nanoserve.runtime.builder import build_engine

_QUESTIONS = ("What is the capital of France?", "Tell me a short story about a cat.", "What is 12 + 30?",
              "Name the days of the week.", "What colour is the sky?", "Count from one to ten.",
              "What do bees make?", "List the months of the year.")
_PASSAGES = ("def add(a, b):\n    return a + b\n\n\n"
             "def scale(values, factor):\n    return [v * factor for v in values]\n",
             "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. ",
             "The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun. ")
_CODE_FILE = '''"""Inventory records: load and validate."""

import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    count: int
    price: float

    def total(self):
        return self.count * self.price


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], int(r["count"]), float(r["price"])) for r in rows]


def validate(items):
    errors = []
    for item in items:
        if item.count < 0:
            errors.append(f"{item.name}: negative count")
        if item.price <= 0:
            errors.append(f"{item.name}: price must be positive")
    return errors
'''
_EDITS = ("Rename `Item` to `Record`", "Rename `load_items` to `read_items`", "Rename `errors` to `problems`",
          "Rename `total` to `value`", "Rename `rows` to `records`", "Rename `validate` to `check`",
          "Rename `count` to `quantity`", "Rename `price` to `unit_price`")
WORKLOADS = ("chat", "repeat", "edit", "edit-file")


def workload_messages(kind: str, n: int) -> list[list[dict[str, str]]]:
    if kind == "chat":
        return [[{"role": "user", "content": _QUESTIONS[i % len(_QUESTIONS)]}] for i in range(n)]
    if kind.startswith("edit"):
        return [[{"role": "user", "content": f"{_EDITS[i % len(_EDITS)]} in this file and write the whole file "
                                             f"again:\n```python\n{_CODE_FILE}```"}] for i in range(n)]
    return [[{"role": "user", "content": "Repeat this text exactly:\n" + _PASSAGES[i % len(_PASSAGES)] * 3}]
            for i in range(n)]


@dataclass(frozen=True, slots=True)
class SpecBenchConfig:
    args: EngineArgs  # with the speculation to measure; the baseline is the same without it
    workload: str = "chat"
    batch_sizes: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    repeats: int = 3  # rounds of interleaved plain and speculative runs; medians are reported


def _params(max_tokens: int, prediction: list[int] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prediction_token_ids=prediction)


def _interleaved(engines: list[LLMEngine], prompts: list[list[int]], max_tokens: int,
                 predictions: list[list[list[int]] | None] | None = None) -> list[tuple[float, int]]:
    """The same greedy requests on every engine (engine e's request i with the prediction
    `predictions[e][i]`, if any), stepped in turn: each time, the engine that has produced the
    smallest share of its tokens takes one step, so all of them progress together and meet the
    same moments of a shared machine. Returns per engine the seconds spent in its own steps and
    the tokens they produced."""
    for e, engine in enumerate(engines):
        given = None if predictions is None else predictions[e]
        for i, p in enumerate(prompts):
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p,
                               _params(max_tokens, None if given is None else given[i]))
    total = max_tokens * len(prompts)
    spent, tokens = [0.0] * len(engines), [0] * len(engines)
    while live := [i for i, e in enumerate(engines) if e.has_unfinished()]:
        i = min(live, key=lambda j: tokens[j])
        start = time.perf_counter()
        tokens[i] += sum(len(d.token_ids) for d in engines[i].step().deltas)
        spent[i] += time.perf_counter() - start
    assert all(t == total for t in tokens), "every request runs to max_tokens (ignore_eos)"
    return list(zip(spent, tokens, strict=True))


def _answers(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy answer of `max_tokens` tokens."""
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _params(max_tokens))
    while engine.has_unfinished():
        for d in engine.step().deltas:
            out[d.request_id] += d.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def edited(tokens: list[int], num_edits: int = 5) -> list[int]:
    """`tokens` with `num_edits` small edits spread evenly over it: at each, three tokens replaced
    by the two that follow them (a word changed for a shorter one)."""
    out = list(tokens)
    for j in reversed(range(num_edits)):
        at = (2 * j + 1) * len(tokens) // (2 * num_edits)
        out[at : at + 3] = tokens[at + 3 : at + 5]
    return out


def run_spec_bench(cfg: SpecBenchConfig, loaded: LoadedModel | None = None) -> list[dict[str, Any]]:
    """One row per batch size; the engines share the loaded target model. Each of `repeats` rounds
    builds a fresh plain and a fresh speculative engine (neither inherits cache state) and runs the
    requests on both, interleaved step by step (`_interleaved`); each rate is the median of its
    rounds and the speed-up the median of the rounds' ratios. Greedy decoding makes every
    speculative run accept the same drafts; acceptance is that of the last one. The `edit` workloads
    compare runs without and with a prediction, on the same engine arguments (speculation is
    optional there)."""
    predicting = cfg.workload.startswith("edit")
    if cfg.args.spec_method is None and not predicting:
        raise ValueError("give --speculative-model or --speculative-method ngram")
    if cfg.repeats < 1:
        raise ValueError("repeats must be at least 1")
    loaded = loaded or load_model(cfg.args.model, dtype=cfg.args.dtype, device=cfg.args.device,
                                  quantization=cfg.args.quantization)
    base = dataclasses.replace(cfg.args, enable_prefix_caching=False)
    if not predicting:
        base = dataclasses.replace(base, speculative_method=None, speculative_model=None)
    spec = dataclasses.replace(cfg.args, enable_prefix_caching=False)
    rows = []
    for batch in cfg.batch_sizes:
        prompts = [loaded.tokenizer.encode_chat(m) for m in workload_messages(cfg.workload, batch)]
        rates: dict[bool, list[float]] = {False: [], True: []}
        stats = SpecStats()
        predictions: list[list[list[int]] | None] | None = None
        for _ in range(cfg.repeats):
            engines = [build_engine(dataclasses.replace(a, max_num_seqs=max(batch, 1)), loaded) for a in (base, spec)]
            for engine in engines:
                _interleaved([engine], prompts[:1], 4)  # warm-up
                engine.spec_stats = SpecStats()
            if cfg.workload == "edit" and predictions is None:
                predictions = [None, [edited(a) for a in _answers(engines[0], prompts, cfg.max_tokens)]]
            elif cfg.workload == "edit-file":
                predictions = [None, [loaded.tokenizer.encode(_CODE_FILE, add_special_tokens=False)] * batch]
            timed = _interleaved(engines, prompts, cfg.max_tokens, predictions)
            for speculating, (elapsed, tokens) in zip((False, True), timed, strict=True):
                rates[speculating].append(tokens / elapsed)
            stats = engines[1].spec_stats
        ratios = sorted(f / p for p, f in zip(rates[False], rates[True], strict=True))
        rows.append({"batch": batch, "plain_tok_s": statistics.median(rates[False]),
                     "spec_tok_s": statistics.median(rates[True]), "speedup": statistics.median(ratios),
                     "speedup_range": (ratios[0], ratios[-1]), "plain_runs": rates[False], "spec_runs": rates[True],
                     "acceptance_rate": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    headers = ["batch", "plain tok/s", "spec tok/s", "speed-up", "(rounds: min-max)", "acceptance", "tokens/verify"]
    return format_table(headers, [[str(r["batch"]), f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                                   f"{r['speedup']:.2f}x", "{:.2f}-{:.2f}".format(*r["speedup_range"]),
                                   f"{r['acceptance_rate']:.1%}", f"{r['mean_accepted_length']:.2f}"] for r in rows])
