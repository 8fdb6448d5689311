"""The tokenizer of a checkpoint: a `tokenizers.Tokenizer` plus special tokens and chat template."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from nanoserve.tokenizer.chat_template import render_chat_template


class Tokenizer:
    """Wraps a `tokenizers.Tokenizer` with the special tokens and chat template of a checkpoint.

    Invariants: `encode` / `decode` give the same ids and text as `transformers`' fast tokenizer
    loaded from the same folder; `stop_token_ids` always contains `eos_token_id` when the model has
    one; the backend is used as given (`from_pretrained_dir` turns off its truncation and padding).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        add_bos_token: bool = False,
        extra_stop_token_ids: Sequence[int] = (),
        tool_chat_template: str | None = None,
    ) -> None:
        """`tool_chat_template` is an optional second template used when a request passes tools
        (the `tool_use` entry of a checkpoint's named templates)."""
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = _token_id(backend, bos_token)
        self.eos_token_id: int | None = _token_id(backend, eos_token)
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template
        self.tool_chat_template = tool_chat_template
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        self.stop_token_ids: frozenset[int] = frozenset((*eos, *extra_stop_token_ids))
        self._special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, extra_stop_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and any chat template files from a folder.

        The chat template comes from `chat_template.jinja` if present, else from the config
        (a string, or a list of named templates of which "default" is taken); a `tool_use`
        template (`additional_chat_templates/tool_use.jinja` or the named list) is kept for tool calls.
        `add_bos_token` is honoured even though transformers 5 ignores it when tokenizer.json exists
        (its Llama tokenizer did honour it in transformers 4; a model trained with BOS needs it).
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: nanoserve needs a Hugging Face fast tokenizer file there"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        legacy_specials = _read_json(folder / "special_tokens_map.json")
        templates = _chat_templates(folder, config.get("chat_template"))
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token", legacy_specials.get("bos_token"))),
            eos_token=_token_content(config.get("eos_token", legacy_specials.get("eos_token"))),
            chat_template=templates.get("default"),
            add_bos_token=bool(config.get("add_bos_token") or False),
            extra_stop_token_ids=extra_stop_token_ids,
            tool_chat_template=templates.get("tool_use"),
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary entry spells (byte-level entries spell one
        character a byte, so no token decodes to more)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the backend's post-processor runs and,
        if `add_bos_token` is set, BOS is prepended unless the result already starts with it."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special (added, `special=True`) tokens are dropped when asked."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def override_chat_template(self, template: str) -> None:
        """Renders every conversation with `template` from now on (`--chat-template`): it replaces
        the checkpoint's template and its tool-use template alike."""
        self.chat_template = template
        self.tool_chat_template = None

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        output_limit: int | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to a prompt string with the checkpoint's chat template (at most
        `output_limit` characters).

        Raises ValueError when the model has no chat template or the template fails.
        """
        template = self.tool_chat_template if tools is not None and self.tool_chat_template else None
        template = template or self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json or chat_template.jinja); "
                "use the completions endpoint or supply a template"
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            output_limit=output_limit,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        output_limit: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat; the template places any BOS itself, so no special
        tokens are added (as `transformers`' `apply_chat_template(tokenize=True)` does)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, output_limit=output_limit, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is an added token marked special (skipped by `skip_special_tokens`)."""
        return token_id in self._special_ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id`, or None if it is out of range."""
        return self.backend.id_to_token(token_id)


def _token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _token_content(value: Any) -> str | None:
    """A special token from a config: a plain string or a serialised AddedToken {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _chat_templates(folder: Path, from_config: Any) -> dict[str, str]:
    """Named chat templates: config entries first, then template files, which take precedence."""
    templates: dict[str, str] = {}
    if isinstance(from_config, str):
        templates["default"] = from_config
    elif isinstance(from_config, list):
        templates.update(
            {t["name"]: t["template"] for t in from_config if isinstance(t, dict) and "name" in t}
        )
    template_dir = folder / "additional_chat_templates"
    if template_dir.is_dir():
        templates.update({f.stem: f.read_text(encoding="utf-8") for f in template_dir.glob("*.jinja")})
    default_file = folder / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    return templates
