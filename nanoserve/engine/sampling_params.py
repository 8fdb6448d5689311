"""Per-request sampling parameters, with the names vLLM and the OpenAI API use, and the pooling
parameters of a request run for its embedding (`PoolingParams`, see `nanoserve.engine.pooling`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

POOLING_METHODS = ("mean", "last")  # over the prompt's final hidden states, or its last one


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on a request's output: exactly one of a JSON schema (`json`, a dict or its JSON
    text), any JSON object (`json_object`), a regular expression (`regex`, matching the whole
    output), one of a list of strings (`choice`), or a grammar (`grammar`: Lark in llguidance's
    dialect, or GBNF, which is converted). Torch-free: the engine compiles it
    (`nanoserve.engine.structured`); `validate` checks only its shape.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The name of the one constraint set."""
        return next(name for name, on in self._given().items() if on)

    def _given(self) -> dict[str, bool]:
        return {"json": self.json is not None, "json_object": self.json_object, "regex": self.regex is not None,
                "choice": self.choice is not None, "grammar": self.grammar is not None}

    def validate(self) -> None:
        """Raises ValueError unless exactly one constraint is set and it has the right shape."""
        given = [name for name, on in self._given().items() if on]
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("a JSON schema is an object")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
        for name, text in (("regex", self.regex), ("grammar", self.grammar)):
            if text is not None and (not isinstance(text, str) or not text.strip()):
                raise ValueError(f"{name} must be a non-empty string")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`method`: "mean" over the prompt's rows or its "last" row; `dimensions`: the first that many
    values of the vector (None: all); `normalize`: to unit L2 norm."""

    method: str = "mean"
    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be positive, got {self.dimensions}")


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` and `min_p == 0` disable those
    filters. `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled token's logprob
    and the k most likely tokens' (k may be 0). Logprobs are those of the model's raw distribution
    (log-softmax of the logits, before penalties, logit bias, temperature and filters).

    Token constraints, applied to the logits after the penalties and before temperature and the
    filters (greedy rows too): `logit_bias` adds a value in [-100, 100] to a token's logit;
    `allowed_token_ids` keeps only those tokens; `bad_words` bans the last token of each word's
    token sequence wherever the output so far ends with the tokens before it.
    `include_stop_str_in_output` keeps a matched stop string at the end of the text.
    `prompt_logprobs=k` returns, for every prompt token after the first, its raw logprob given the
    tokens before it and the k most likely tokens there.
    `structured` constrains the output to a JSON schema, regex, choice or grammar (see
    `StructuredOutputs`).
    `prediction` is text the output is expected to mostly repeat (OpenAI's Predicted Outputs): its
    tokens are proposed as drafts and verified exactly, so it changes the speed, never the output.
    `pooling` makes the request a pooling one (see `nanoserve.engine.pooling`): its prompt is run for
    one embedding, nothing is generated, and no other field applies (`n` is 1).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    prediction: str | None = None
    # `bad_words` as token sequences (see `resolve_bad_words`); filled by the front end or the engine.
    bad_words_token_ids: list[list[int]] | None = None
    # `prediction` as tokens (see `resolve_prediction`); filled by the front end or the engine.
    prediction_token_ids: list[int] | None = None
    pooling: PoolingParams | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_token_constraints(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed must be a 64-bit signed integer"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
            (self.structured is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured output (the grammar decides where the output ends)"),
            (all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in (self.logit_bias or {}).items()),
             "logit_bias must map token ids to biases in [-100, 100]"),
            (self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0
                                                and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids"),
            (all(isinstance(w, str) and w for w in self.bad_words), "bad_words must be a list of non-empty strings"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (self.prediction is None or isinstance(self.prediction, str), "prediction must be a string"),
            (self.pooling is None or (self.n == 1 and self.prompt_logprobs is None and self.structured is None),
             "a pooling request takes n = 1 and neither prompt_logprobs nor structured output"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class WordEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def resolve_bad_words(params: SamplingParams, tokenizer: WordEncoder) -> None:
    """Fills `params.bad_words_token_ids` from `params.bad_words`, once: each word as it is
    tokenized alone and after a space (the form it takes inside a text), duplicates dropped."""
    if params.bad_words_token_ids is not None or not params.bad_words:
        return
    sequences: list[list[int]] = []
    for word in params.bad_words:
        for form in (word, " " + word.lstrip()):
            ids = tokenizer.encode(form, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    params.bad_words_token_ids = sequences


def resolve_prediction(params: SamplingParams, tokenizer: WordEncoder) -> None:
    """Fills `params.prediction_token_ids` from `params.prediction`, once (no special tokens)."""
    if params.prediction_token_ids is not None or params.prediction is None:
        return
    params.prediction_token_ids = tokenizer.encode(params.prediction, add_special_tokens=False)
