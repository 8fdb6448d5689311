"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per event, `data: [DONE]\\n\\n` last."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: finished, client gone
    (Starlette cancels the body when the client disconnects) or server shutdown."""

    def __init__(self, events: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._events.aclose()
