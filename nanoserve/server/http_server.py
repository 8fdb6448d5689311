"""Running an app under uvicorn: in the foreground until a signal (`nanoserve serve`), or on a
background thread bound to a loopback port (`nanoserve chat`, tests); either way by `DrainingServer`,
whose graceful shutdown ends the streams still open with an error event rather than cutting them,
and under `ConnectionLimits` (header deadline, keep-alive, connection cap: `connection_limits`)."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import httpx
import uvicorn

from nanoserve.server.connection_limits import ConnectionLimits, LimitedConfig

# Seconds before uvicorn's graceful shutdown would cancel what still runs, when the engine is stopped.
DRAIN_MARGIN_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown stops the app's engine (`app.state.engine`, an
    `AsyncEngine`) `DRAIN_MARGIN_S` before its `timeout_graceful_shutdown` runs out: every request
    still in the engine then fails with "the server is shutting down", so each cut stream writes its
    error event and [DONE] and ends by itself, and nothing is cancelled mid-write. Without a
    timeout, in-flight requests are waited for, as uvicorn does."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        grace = self.config.timeout_graceful_shutdown
        cut: asyncio.Task[None] | None = None
        if engine is not None and grace is not None:
            async def cut_streams() -> None:
                await asyncio.sleep(max(grace - DRAIN_MARGIN_S, 0.0))
                await engine.stop()

            cut = asyncio.create_task(cut_streams())
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


def serve_until_signal(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then stops accepting connections, gives in-flight requests
    the config's `timeout_graceful_shutdown` seconds to finish (a `DrainingServer` ends the streams
    still open just before with an error event), cancels the rest, stops the engine and returns.
    uvicorn re-raises the signal it caught once it has shut down; the no-op handlers installed
    beneath its own turn that into a plain return (exit status 0). `sockets`: listening sockets
    bound beforehand (else uvicorn binds the config's host and port)."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _ignore) for sig in handled}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(sig: int, frame: FrameType | None) -> None:
    """A handler that does nothing (see serve_until_signal)."""


class ServerThread:
    """uvicorn serving an app on a daemon thread (no signal handling there), under `limits`. Use as
    a context manager: `url` is set on entry (port 0 picks a free port); exit shuts the server down."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, limits: ConnectionLimits | None = None,
                 **config: Any) -> None:
        config.setdefault("log_level", "warning")
        self.server = DrainingServer(LimitedConfig(app, limits, host=host, port=port, **config))
        self._thread = threading.Thread(target=self.server.run, name="nanoserve-http", daemon=True)
        self.url = ""

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Waits until /health answers 200 (the model is loaded); raises if it never does."""
        deadline = time.monotonic() + timeout
        while (r := httpx.get(f"{self.url}/health")).status_code != 200:
            dead = r.json().get("error", {}).get("code") == "engine_dead"
            if dead or time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the model did not load; see the log above")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)
