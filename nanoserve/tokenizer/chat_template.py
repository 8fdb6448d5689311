"""Chat templates: render a conversation to a prompt string the way `transformers` does.

Chat templates ship with checkpoints and are untrusted code. They run only inside Jinja's
`ImmutableSandboxedEnvironment` (no underscore attributes, no mutation of the inputs), their
namespaces refuse underscore names, and everything they see is first rebuilt from plain JSON
types. Every failure (syntax, runtime, `raise_exception`, sandbox violation) leaves this module as
a `ChatTemplateError`, a `ValueError`, so a server can answer it as a bad request.

Bounds: a template may not build a string, list or integer over `MAX_BUILT_SIZE` with `*`, `**` or
the padding methods of strings (`ljust`, `center`, ...), may not print anything but data (a
function's or an object's repr, with its memory address, is refused), and its output stops at the
caller's `output_limit`. Time and memory are the caller's to bound (a server renders in a worker
process with a deadline and a memory limit: `prompt_pool`).

The rendering environment matches `transformers.apply_chat_template(..., tokenize=False)`:
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag that
renders its body unchanged, the `raise_exception` and `strftime_now` globals, and a `tojson`
filter that does not escape HTML or non-ASCII text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning text may arrive under; templates read the first (Qwen3) or `thinking`.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# The largest string or list (in items) or integer (in bits) a template may build in one operation:
# far beyond any real prompt's pieces, far below what would stall the process that renders it.
MAX_BUILT_SIZE = 1 << 20
_PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or called `raise_exception(message)`.

    For `raise_exception`, `str(error)` is the template's message verbatim.
    """


class ChatTemplateSecurityError(ChatTemplateError):
    """A chat template tried something the sandbox forbids (e.g. reaching Python internals)."""


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    output_limit: int | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (OpenAI-style dicts) with the Jinja chat `template`.

    As `transformers` does: message keys whose value is None are dropped (templates handle a
    missing key better than a literal None), a message's reasoning is exposed as both
    `reasoning_content` and `thinking`, `bos_token` / `eos_token` are defined only when given, and
    extra `kwargs` (e.g. `enable_thinking`, `documents`) become template variables.
    Raises `ChatTemplateError` (or `ChatTemplateSecurityError`) on any template failure, and when
    the output would pass `output_limit` characters (rendering stops there).
    """
    compiled = _compile(template)
    variables: dict[str, Any] = {"documents": None, **kwargs}
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables = _plain(variables)
    variables["messages"] = [_prepare_message(m) for m in messages]
    variables["tools"] = _plain(tools)
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return _joined(compiled.generate(**variables), output_limit)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateSecurityError(f"chat template rejected by the sandbox: {exc}") from exc
    except MemoryError as exc:
        raise ChatTemplateError("the chat template ran out of the memory it may use") from exc
    except Exception as exc:  # untrusted template code: any failure is the template's
        raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc


def load_chat_template(value: str) -> str:
    """The template `--chat-template VALUE` names (vLLM's flag): the text of the file at path
    `value` if there is one, else `value` itself when it reads as Jinja (holds `{{` or `{%`).
    Raises ChatTemplateError for a value that is neither, and for a template that does not compile."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a literal template: a name too long for a path, a NUL
        is_file = False
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template {value}: cannot read the file ({e})") from None
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ChatTemplateError(f"--chat-template {value!r}: no such file, and not a Jinja template "
                                "(a literal template holds {{ or {%)")
    _compile(template)
    return template


def _joined(pieces: Iterator[str], limit: int | None) -> str:
    out: list[str] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if limit is not None and size > limit:
            raise ChatTemplateError(f"the chat template's output passed the limit of {limit} characters")
        out.append(piece)
    return "".join(out)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` and the padding methods of strings checked before they run
    (Jinja's sandbox lets them build values of any size), and only data printed."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_product(left, right)
        elif isinstance(left, int) and isinstance(right, int) and right * abs(left).bit_length() > MAX_BUILT_SIZE:
            raise SecurityError(f"the chat template raised an integer to a power over {MAX_BUILT_SIZE} bits")
        return super().call_binop(context, operator, left, right)

    def call(self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(__obj, "__name__", None) in _PADDING_METHODS and isinstance(getattr(__obj, "__self__", None), str):
            width = args[0] if args else kwargs.get("width", kwargs.get("tabsize", 0))
            if isinstance(width, int) and width > MAX_BUILT_SIZE:
                raise SecurityError(f"the chat template padded a string past {MAX_BUILT_SIZE} characters")
        return super().call(__context, __obj, *args, **kwargs)


def _check_product(left: Any, right: Any) -> None:
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_BUILT_SIZE:
            raise SecurityError(f"the chat template built a value of more than {MAX_BUILT_SIZE} items with *")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_BUILT_SIZE:
        raise SecurityError(f"the chat template built an integer of more than {MAX_BUILT_SIZE} bits with *")


def _printable(value: Any) -> Any:
    """What `{{ ... }}` may print: data (text, numbers, containers of data, undefined); never the
    repr of a function, module or other object (with its memory address)."""
    if isinstance(value, (str, int, float, type(None), jinja2.Undefined)):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            _printable(item)
        return value
    if isinstance(value, dict):
        for key, item in value.items():
            _printable(key)
            _printable(item)
        return value
    raise SecurityError(f"the chat template tried to print a {type(value).__name__}, which is not data")


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile `template` in a fresh sandboxed environment (memoised per template string)."""
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
        finalize=_printable,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """Stands in for `dict` in templates: builds dicts, but exposes no type to climb from."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` whose attribute names may not start with an underscore.

    `self` is taken from `*args` (as Jinja's own `Namespace` does) so `namespace(self=...)` works.
    """

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_public(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_public(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_public(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} is not allowed (leading underscore)")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training): renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares a plain set attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys and alias the reasoning text under every name templates read."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be dicts, got {type(message).__name__}")
    plain = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_KEYS if k in plain), None)
    if reasoning is None:
        return plain
    return {"thinking": reasoning, **plain, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuild `value` from exact JSON types; anything else becomes an inert "<TypeName>" string.

    Invariant: the result contains only dict, list, tuple, str, int, float, bool and None, so a
    template cannot reach methods of caller-supplied objects (enums, models, arrays).
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic models
        return _plain(dump())
    return f"<{type(value).__name__}>"
