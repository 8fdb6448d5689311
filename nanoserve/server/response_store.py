"""The responses kept for `store: true` and `previous_response_id`: a bounded LRU in memory.

Owned by the app (`build_app` makes one per app, sized by `--responses-store-size`); nothing
survives a restart. Invariants: it never holds more than `capacity` responses (storing one more
evicts the least recently stored or read); a capacity of 0 stores nothing. Only the event loop
touches it (the handlers and their streams), so it takes no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RESPONSES_STORE_SIZE = 256


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response as GET returns it, its input items as /input_items lists them (oldest
    first), and its conversation in chat form (the input messages, without instructions, then the
    output as one assistant message), which a request naming it as `previous_response_id`
    continues."""

    body: dict[str, Any]
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class ResponseStore:
    capacity: int = DEFAULT_RESPONSES_STORE_SIZE
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError("the responses store size must be >= 0")

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
