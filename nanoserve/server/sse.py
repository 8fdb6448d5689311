"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per event, `data: [DONE]\\n\\n` last.

While a stream is silent for `keep_alive_s` (a long prefill, a full queue), a comment line
`: keep-alive` goes out, as often as that, so proxies and clients with read timeouts keep the
connection; SSE clients ignore comment lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
DEFAULT_KEEP_ALIVE_S = 15.0


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _KeepAlive:
    """The events of `events`, with KEEP_ALIVE after every `interval_s` without one.

    Invariant: at most one `__anext__` of `events` is in flight (`_next`), and it is never
    cancelled while the stream runs (cancelling would end the generator); `aclose` cancels it,
    waits for it, then closes `events`.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], interval_s: float) -> None:
        self._events = events
        self._interval_s = interval_s
        self._next: asyncio.Future[bytes] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self._events))
        done, _ = await asyncio.wait({self._next}, timeout=self._interval_s)
        if not done:
            return KEEP_ALIVE
        next_event, self._next = self._next, None
        return next_event.result()  # StopAsyncIteration ends the iteration

    async def aclose(self) -> None:
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(BaseException):
                await self._next
            self._next = None
        await self._events.aclose()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: finished, client gone
    (Starlette cancels the body when the client disconnects) or server shutdown. With
    `keep_alive_s`, a silent stream sends a keep-alive comment that often (None: never)."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None],
                 keep_alive_s: float | None = None) -> None:
        self._events = _KeepAlive(events, keep_alive_s) if keep_alive_s else events
        super().__init__(self._events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()
