"""Tokenizer, chat templates and incremental detokenizer.

The names below are imported on first use (PEP 562), so importing a light module of the package
(`prompt_pool`'s defaults, for the CLI's parser) does not load jinja2 and the tokenizers library."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.tokenizer.chat_template import ChatTemplateError, ChatTemplateSecurityError, render_chat_template
    from nanoserve.tokenizer.detokenizer import IncrementalDetokenizer
    from nanoserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "render_chat_template",
]

_EXPORTS = {"ChatTemplateError": "chat_template", "ChatTemplateSecurityError": "chat_template",
            "render_chat_template": "chat_template", "IncrementalDetokenizer": "detokenizer",
            "Tokenizer": "tokenizer"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
