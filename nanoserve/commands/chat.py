"""`nanoserve chat`: an interactive terminal chat that streams each reply as it is generated.

Talks HTTP (OpenAI chat completions with SSE) to `--url`, or to a server it starts in-process on
a free loopback port for MODEL. The conversation is kept; Ctrl-C during a reply stops it (closing
the stream, so the server aborts the request) and keeps what was shown; Ctrl-D quits. httpx's
per-request log lines stay out of the transcript (shown at --log-level DEBUG only). Its parser
imports nothing heavy; `run` imports the engine and the server when it serves MODEL itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from nanoserve.commands.common import add_engine_args, add_model_arg, engine_args_from
from nanoserve.server.defaults import DEMO_MODEL_NAME
from nanoserve.settings import add_config_arg

if TYPE_CHECKING:
    import httpx

HELP = "Ctrl-D or /exit quits, /clear starts over, Ctrl-C stops a reply."


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model in the terminal")
    add_model_arg(p)
    add_config_arg(p)
    p.add_argument("--url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (MODEL, if "
                   "given, is then the model name to ask for); default: serve MODEL in-process")
    p.add_argument("--api-key", help="bearer key for --url (default: none)")
    p.add_argument("--system", help="system prompt (default: none)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import httpx

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # no "HTTP Request: ..." lines in the chat
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if ns.url:
        with _client(ns.url, ns.api_key) as client:
            try:
                model = ns.model or client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            except httpx.HTTPError as e:
                print(f"nanoserve: error: cannot use the server at {ns.url}: {e}", file=sys.stderr)
                return 1
            return chat_loop(client, model, ns)
    from nanoserve.runtime.builder import build_engine
    from nanoserve.server import ServerConfig, build_app
    from nanoserve.server.http_server import ServerThread

    name = ns.model or DEMO_MODEL_NAME
    app = build_app(build_engine(engine_args_from(ns)), ServerConfig(served_model_name=name))
    with ServerThread(app) as server, _client(server.url, None) as client:
        server.wait_healthy()
        return chat_loop(client, name, ns)


def _client(url: str, api_key: str | None) -> httpx.Client:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(None, connect=10.0))


def chat_loop(client: httpx.Client, model: str, ns: argparse.Namespace, read: Callable[[str], str] | None = None,
              out: TextIO | None = None) -> int:
    """Reads user turns with `read` (default: input) until EOF (Ctrl-D) and streams each reply to
    `out` (default: stdout)."""
    read = read or input
    out = out or sys.stdout
    start: list[dict[str, Any]] = [{"role": "system", "content": ns.system}] if ns.system else []
    messages = list(start)
    out.write(f"Chatting with {model}. {HELP}\n")
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/clear":
            messages = list(start)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": ns.max_tokens,
                "temperature": ns.temperature}
        reply = stream_reply(client, body, out)
        if reply is None:
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": reply})


def stream_reply(client: httpx.Client, body: dict[str, Any], out: TextIO) -> str | None:
    """Streams one reply to `out`; returns its text (what was shown, if interrupted), or None
    if the server refused the request or could not be reached."""
    import httpx

    parts: list[str] = []
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                out.write(f"[error {response.status_code}: {_message(response.text)}]\n")
                return None
            for line in response.iter_lines():
                data = line.removeprefix("data: ")
                if data == line or data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.write(f"\n[error: {event['error'].get('message')}]")
                    break
                for choice in event["choices"]:
                    text = choice["delta"].get("content") or ""
                    out.write(text)
                    out.flush()
                    parts.append(text)
    except KeyboardInterrupt:
        out.write(" [stopped]")  # leaving the `with` closed the connection: the server aborts the reply
    except httpx.HTTPError as e:
        out.write(f"[error: {e}]\n")
        return None
    out.write("\n")
    return "".join(parts)


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text
