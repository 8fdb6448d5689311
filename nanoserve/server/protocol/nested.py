"""The one base of the models nested in request bodies (a tool, a content block, `stream_options`,
`text.format`, ...): a field such a model does not define is refused where it is sent.

Invariants: an unknown field sent as null is unset (as at the top level); any other makes
validation fail with an error of type `unsupported_field` whose `ctx["field"]` is the field's name,
so that `errors.invalid_request` answers a 400 naming the field's whole path (`text.format.foo`),
in the route's error shape. The top level's unknown fields are refused by `Serving.check_request`
(which `--ignore-unknown-fields` can relax); a nested one always is. A nested model's JSON schema
says the same: further properties only as null.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.server.protocol.errors import UNSUPPORTED_FIELD


class NestedModel(BaseModel):
    """A model nested in a request body: strict types; a field it does not define is an error
    (unless sent as null) that names it."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": {"type": "null"}})

    def refused_as_a_whole(self) -> bool:
        """Whether what reads this part refuses it whatever its fields (a content part of a type
        nanoserve does not take): then the 400 says that, rather than name a field of it."""
        return False

    @model_validator(mode="after")
    def _known_fields_only(self) -> Self:
        if self.refused_as_a_whole():
            return self
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            also = f" (also {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
            raise PydanticCustomError(UNSUPPORTED_FIELD, "unsupported field" + also, {"field": unknown[0]})
        return self
