"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per event, `data: [DONE]\\n\\n` last
(Anthropic's: `named_event`).

While a stream is silent for `keep_alive_s` (a long prefill, a full queue), a comment line
`: keep-alive` goes out, as often as that, so proxies and clients with read timeouts keep the
connection; SSE clients ignore comment lines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def event(payload: Any) -> bytes:
    """One `data:` event. Text goes out as UTF-8 (`ensure_ascii=False`), but with U+0085, U+2028 and
    U+2029 escaped: json.dumps leaves them raw, and line readers built on str.splitlines (httpx's
    `iter_lines`, so many Python SSE clients) take them for line ends, which would cut the event in
    two. JSON allows the escapes anywhere in a string, and outside strings these characters never
    occur, so the payload reads back the same."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    if not text.isascii():
        text = text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return b"data: " + text.encode() + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    """An event with an `event:` line, as Anthropic's and the Responses API's streams carry one per event
    (no [DONE])."""
    return b"event: " + name.encode() + b"\n" + event(payload)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: finished, client gone
    (Starlette cancels the body when the client disconnects) or server shutdown. With
    `keep_alive_s`, a stream silent that long gets a keep-alive comment, and again after each
    further `keep_alive_s` of silence (None: never).

    The keep-alive costs the per-event path one clock read: a companion task sleeps until the
    stream has been silent for `keep_alive_s` and only then writes (each ASGI body message is
    written whole, so its writes never split an event)."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None],
                 keep_alive_s: float | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._keep_alive_s = keep_alive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        interval = self._keep_alive_s
        loop = asyncio.get_running_loop()
        last_sent = loop.time()

        async def keep_alive(interval: float) -> None:
            nonlocal last_sent
            while True:
                await asyncio.sleep(last_sent + interval - loop.time())
                if loop.time() - last_sent >= interval:
                    await send({"type": "http.response.body", "body": KEEP_ALIVE, "more_body": True})
                    last_sent = loop.time()

        pinger = asyncio.create_task(keep_alive(interval)) if interval else None
        try:
            async for chunk in self._events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last_sent = loop.time()
        finally:
            if pinger is not None:
                pinger.cancel()
                await asyncio.wait({pinger})  # its cancellation is not ours: nothing to re-raise
        await send({"type": "http.response.body", "body": b"", "more_body": False})
