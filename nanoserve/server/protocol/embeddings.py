"""The body of POST /v1/embeddings (OpenAI's embeddings API), as a strict pydantic model.

`input` is a string, a list of strings, a list of token ids, or a list of such lists; each string
or token list is one engine request. Unknown fields are kept in `model_extra` and refused by the
handler, as for the other endpoints."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, WithJsonSchema

from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.openai import PROMPT_SCHEMA


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None  # the end user's id (OpenAI's abuse monitoring): changes no output

    def inputs(self) -> list[str | list[int]]:
        """One entry per vector asked for, in order; a 400 naming `input` when there is none or
        one is empty."""
        given = self.input
        single = isinstance(given, str) or not given or isinstance(given[0], int)
        batch = cast(list[str | list[int]], [given] if single else list(given))
        if not batch or any(len(x) == 0 for x in batch):
            raise APIError(400, "the input is empty", param="input")
        return batch
