"""What one HTTP connection may hold of the server: the time to send a request's head, the idle
time between requests, and a place among at most `max_connections` open ones.

uvicorn bounds the idle time between two requests (`timeout_keep_alive`) but not the time a client
takes to send a request line and headers: a client that trickles a header a byte at a time
("slowloris") holds its connection, and uvicorn's `limit_concurrency` only answers a request whose
head has arrived, so such connections would also fill any connection cap. `GuardedH11Protocol`
(uvicorn's h11 protocol, which it uses when httptools is not installed) adds both:

- a header deadline: whenever the connection waits for a request's head (from the moment it is
  accepted, and again from the end of each response), the whole head must have arrived within
  `header_timeout_s`, however the bytes are spread; past it the connection is closed, after a 408
  if part of a head had arrived (an idle keep-alive connection is closed silently, so that a client
  reusing it never reads a stale 408 as its next answer);
- a connection cap: a connection accepted while `max_connections` others are open answers its
  first request with a 503 (in the route's error shape, `Retry-After`, `Connection: close`) and
  is then closed; the connections already open are not disturbed.

`LimitedConfig` is uvicorn's `Config` with these limits and that protocol.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from nanoserve.server.defaults import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from nanoserve.server.protocol.errors import APIError

log = logging.getLogger(__name__)

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """`header_timeout_s`: seconds a waiting connection gets to deliver a whole request head.
    `keep_alive_s`: seconds an idle connection is kept between requests. `max_connections`: open
    connections beyond which a new one is refused with a 503."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    keep_alive_s: int = DEFAULT_IDLE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.keep_alive_s <= 0 or self.max_connections < 1:
            raise ValueError("the header and keep-alive timeouts must be positive and max_connections at least 1")


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config serving HTTP/1.1 through `GuardedH11Protocol` under `limits` (uvicorn's own
    `limit_concurrency` stays unset: the protocol caps connections itself)."""

    def __init__(self, app: Any, limits: ConnectionLimits | None = None, **kwargs: Any) -> None:
        self.limits = limits or ConnectionLimits()
        super().__init__(app, http=GuardedH11Protocol, timeout_keep_alive=self.limits.keep_alive_s, **kwargs)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (see the module's
    docstring). Invariant: `_head_timer` is armed exactly while the connection waits for a
    request's head (h11's client state is IDLE) and is open, and it is armed when that wait
    begins, never re-armed by the bytes that arrive during it."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.limits if isinstance(config, LimitedConfig) else ConnectionLimits()
        self._head_timer: asyncio.TimerHandle | None = None
        self._over_cap = False
        self._app = self.app
        self.app = self._guarded_app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._over_cap = len(self.connections) > self.limits.max_connections
        if self._over_cap:
            log.warning("refusing a connection from %s: %d connections are open (--max-connections %d)",
                        self.client, len(self.connections) - 1, self.limits.max_connections)
        self._sync_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    async def _guarded_app(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if not self._over_cap:
            await self._app(scope, receive, send)
            return
        error = APIError(503, f"the server has {self.limits.max_connections} connections open, its limit; "
                              "retry later", code="too_many_connections",
                         headers={"Retry-After": "1", "Connection": "close"})
        await error.response(str(scope.get("path", "")))(scope, receive, send)  # type: ignore[arg-type]

    def _sync_head_timer(self) -> None:
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:
            log.info("closing a connection from %s: no complete request head within %g s",
                     self.client, self.limits.header_timeout_s)
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()
