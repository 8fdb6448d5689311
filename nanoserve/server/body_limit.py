"""A bound on request bodies: a body over `max_bytes` is a 413 (in the route's API's error shape),
refused from its Content-Length before a byte of it is read, or, for a body sent without one, as
soon as the bytes read pass the bound; never parsed, never held whole in memory."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.server.protocol.errors import APIError


class BodyLimit:
    """ASGI middleware holding every HTTP request body to `max_bytes`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response(scope["path"])(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, bounded, send)
