"""The bounds of a prompt pool's calls (`prompt_pool.PromptPool`): a module of its own, free of the
pool's imports, so the CLI's parser can show the defaults."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_BYTES = 4 << 30  # a worker's address space: its interpreter, tokenizer and one request


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """A pool's bounds: seconds a call may take, and the address space of a worker process (None:
    unlimited)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES
