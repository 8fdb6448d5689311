"""The router in front of data-parallel replicas: sglang-router (the SGLang Model Gateway), an
existing Rust router from PyPI, run as a subprocess of `nanoserve serve --data-parallel-size N`.

nanoserve does not route requests itself. With `cache_aware` the router keeps an approximate radix
tree of the request texts it sent to each replica and sends a request to the replica whose tree
matches most of it (when the match is above its cache threshold and the load is balanced), so the
requests sharing a system prompt meet that prompt in one replica's prefix cache; `round_robin`
ignores the text. The router re-serializes each request through its own OpenAI types, so it
forwards only the fields it knows (see docs/scale_out.md).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

ROUTER_POLICIES = ("cache_aware", "round_robin")
ROUTER_PACKAGE = "sglang_router"
INSTALL_HINT = "pip install 'nanoserve[router]' (or: pip install -c constraints.txt sglang-router)"
_KEY_VARIABLE = "NANOSERVE_ROUTER_API_KEY"
# The router's own launcher, told the API key through the environment (its command line, which
# `ps` shows, only takes it as a flag).
_LAUNCH = (f"import os, sys; from sglang_router.launch_router import main; key = os.environ.pop({_KEY_VARIABLE!r}, "
           "None); sys.argv += ['--api-key', key] if key else []; main()")
# nanoserve's log levels -> the router's: it logs every request at info and warns of what the supervisor
# reports itself (a replica gone) or what does not apply (no tokenizer for a model it only forwards to).
_LOG_LEVELS = {"DEBUG": "info", "INFO": "error", "WARNING": "error", "ERROR": "error"}


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Invariants: `policy` is one of ROUTER_POLICIES; `workers` is not empty. The router answers
    the OpenAI API on host:port and serves its own Prometheus metrics on host:metrics_port. With
    `api_key` the router answers 401 to a request without it (its worker-management endpoints
    included) and sends it on to the workers, which check it again."""

    host: str
    port: int
    metrics_port: int
    workers: tuple[str, ...]
    policy: str = "cache_aware"
    shutdown_grace_s: float = 30.0
    log_level: str = "INFO"
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"the router policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if not self.workers:
            raise ValueError("the router needs at least one worker")

    def command(self) -> list[str]:
        """The router's command line (run it with `env`). Health checks every 2 s and a worker out
        after 2 failed ones make a dead replica drop out within seconds, not the default minutes;
        until then the router's retries send a failed request to another worker."""
        require_router()
        return [sys.executable, "-c", _LAUNCH,
                "--host", self.host, "--port", str(self.port), "--worker-urls", *self.workers,
                "--policy", self.policy, "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                "--health-success-threshold", "1", "--shutdown-grace-period-secs", str(round(self.shutdown_grace_s)),
                "--log-level", _LOG_LEVELS.get(self.log_level, "error")]

    def env(self) -> dict[str, str]:
        """Environment variables the command needs on top of this process's."""
        return {_KEY_VARIABLE: self.api_key} if self.api_key else {}


def require_router() -> None:
    """Raises ValueError, saying how to install it, when sglang-router is not installed."""
    if importlib.util.find_spec(ROUTER_PACKAGE) is None:
        raise ValueError(f"--data-parallel-size needs sglang-router, which is not installed: {INSTALL_HINT}")
