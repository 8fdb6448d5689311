"""Tokenizer, chat templates and incremental detokenizer."""

from nanoserve.tokenizer.chat_template import (
    ChatTemplateError,
    ChatTemplateSecurityError,
    render_chat_template,
)
from nanoserve.tokenizer.detokenizer import IncrementalDetokenizer
from nanoserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "render_chat_template",
]
