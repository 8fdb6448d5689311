"""The `nanoserve` command as a user meets it: help and version without torch, every default
stated, flag values from a --config file and NANOSERVE_<FLAG> variables in their precedence,
startup errors as one line before anything loads, and the one "ready" line of `serve` (real
processes on loopback)."""

from __future__ import annotations

import argparse
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from nanoserve import __version__, cli
from nanoserve.runtime.async_engine import LOAD_CANCEL_GRACE_S
from nanoserve.settings import DefaultsFormatter
from tests.support.server import make_engine, serve

COMMAND = [sys.executable, "-m", "nanoserve.cli"]
LOAD_TIMEOUT_S = 300.0


def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_help_and_version_import_no_torch() -> None:
    """Parsing (and answering --help or --version) never imports torch, nor the server."""
    probe = (
        "import sys\n"
        "from nanoserve import cli\n"
        "for argv in (['--help'], ['--version'], ['serve', '--help'], ['generate', '--help'], ['chat', '--help'],\n"
        "             ['serve', 'some/model', '--port', '1', '--threads', '2']):\n"
        "    try:\n"
        "        cli.build_parser(argv).parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'nanoserve.server.app') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr
    version = _run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"nanoserve {__version__}"


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_every_flag_states_its_default(command: str) -> None:
    parser = cli.build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = DefaultsFormatter(command)
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action) or ""
        assert "default" in text, f"{action.option_strings or action.dest}: {text!r}"
    assert "the command line wins over the environment" in " ".join(sub.format_help().split())


def _serve_args(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(argv).parse_args(argv)


def test_command_line_beats_environment_beats_file_beats_default(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax-num-seqs: 3\nmax_model_len: 128\nallowed-origins: [a, b]\n"
                      "enable-prefix-caching: false\ntool-call-parser: hermes\n")
    monkeypatch.setenv("NANOSERVE_PORT", "9002")
    monkeypatch.setenv("NANOSERVE_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("NANOSERVE_THREADS", "1")
    ns = _serve_args(["serve", "--config", str(config), "--port", "9003"])
    assert ns.port == 9003  # the command line
    assert ns.max_num_seqs == 5 and ns.threads == 1  # the environment
    assert ns.max_model_len == 128 and ns.allowed_origins == ["a", "b"] and ns.enable_prefix_caching is False
    assert ns.tool_call_parser == "hermes"  # the file
    assert ns.block_size == 16 and ns.host == "127.0.0.1"  # the defaults
    monkeypatch.delenv("NANOSERVE_PORT")
    assert _serve_args(["serve", "--config", str(config)]).port == 9001
    monkeypatch.setenv("NANOSERVE_ENABLE_PREFIX_CACHING", "yes")
    assert _serve_args(["serve", "--config", str(config)]).enable_prefix_caching is True


@pytest.mark.parametrize(("content", "env", "expected"), [
    ("port: 1\nmax-num-seq: 4\n", {}, "'max-num-seq' is not a flag of `nanoserve serve`"),
    ("kv: sideways\n", {}, "kv: invalid choice 'sideways'"),
    ("- port\n", {}, "expected a mapping of flag names to values"),
    ("", {"NANOSERVE_PORT": "eighty"}, "NANOSERVE_PORT: invalid value 'eighty'"),
    ("", {"NANOSERVE_ENABLE_PREFIX_CACHING": "maybe"}, "NANOSERVE_ENABLE_PREFIX_CACHING: expected true or false"),
])
def test_a_bad_setting_is_one_line_naming_it(tmp_path: Path, content: str, env: dict[str, str],
                                             expected: str) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(content)
    done = _run("serve", "--config", str(config), env=env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr


def test_a_port_in_use_is_one_line_before_anything_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run("serve", "--port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"nanoserve: error: cannot listen on 127.0.0.1:{port}: Address already in use (pick another --port, or "
        "stop what listens there)"]


@pytest.mark.parametrize("model", ["/no/such/model.gguf", "./missing-folder"])
def test_a_missing_model_is_one_line_before_anything_loads(model: str) -> None:
    done = _run("serve", model, "--port", str(_free_port()))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"nanoserve: error: model {model!r} not found: no such file or folder"]


def test_flags_that_disagree_are_one_line() -> None:
    done = _run("serve", "--port", str(_free_port()), "--speculative-method", "draft")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "nanoserve: error: speculative_method='draft' needs a draft model (speculative_model)"]
    traced = _run("--log-level", "DEBUG", "serve", "--port", str(_free_port()), "--threads", "0")
    assert traced.returncode == 2 and "Traceback" in traced.stderr and "threads must be at least 1" in traced.stderr


def _lines_until(proc: subprocess.Popen[str], found: Callable[[str], bool], timeout: float) -> list[str]:
    """stderr lines of `proc` up to and including the first one `found` accepts."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=1.0):
                assert proc.poll() is None, "".join(lines)
                continue
            line = proc.stderr.readline()
            assert line, "the server exited: " + "".join(lines)
            lines.append(line)
            if found(line):
                return lines
    raise AssertionError("no ready line in time: " + "".join(lines))


def test_serve_logs_its_stages_then_one_ready_line(demo_dir: Path) -> None:
    port = _free_port()
    argv = [*COMMAND, "serve", str(demo_dir), "--port", str(port), "--served-model-name", "tiny", "--threads", "1",
            "--num-kv-blocks", "16", "--max-model-len", "64", "--prompt-workers", "1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        lines = _lines_until(proc, lambda line: " ready in " in line, LOAD_TIMEOUT_S)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    # uvicorn's access log follows --log-level (INFO); its start and stop lines do not show
    assert re.search(r" INFO MainProcess uvicorn\.access: .*\"GET /health HTTP/1\.1\" 200", rest), rest
    assert "Shutting down" not in rest and "Finished server process" not in rest
    url = f"http://127.0.0.1:{port}"
    ready = lines[-1]
    assert re.search(rf"ready in [\d.]+ s: API {url}/v1, chat page {url}/, dashboard {url}/dashboard; model tiny, "
                     r"dtype \w+, weights dense, 1 thread, KV capacity 256 tokens \(16 blocks of 16\)$", ready), ready
    text = "".join(lines)
    assert "Application startup complete" not in text and "Uvicorn running" not in text
    assert "Traceback" not in text
    for stage in ("importing the server and the engine", "/health answers 503 until it is ready", f"loading {demo_dir}",
                  "KV cache: 16 blocks of 16 tokens"):
        assert sum(stage in line for line in lines) == 1, (stage, text)


CTRL_C_BOUND_S = 20.0  # seconds from Ctrl-C to exit: generous for a busy machine; the load here never ends


def _engine_process(pid: int) -> list[psutil.Process]:
    """The children of `pid` once its engine-core process has started (waiting for it)."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while True:
        children = psutil.Process(pid).children()
        if any("spawn_main" in " ".join(c.cmdline()) for c in children):
            return children
        assert time.monotonic() < deadline, "no engine process"
        time.sleep(0.05)


@pytest.mark.parametrize(("after", "code", "said"), [
    ("importing the server and the engine", 130, "nanoserve: interrupted"),
    ("/health answers 503 until it is ready", 0, "stopping the engine while it loads the model"),  # still importing
    ("loading {model}\n", 0, "stopping the engine while it loads the model"),  # the engine process's line
], ids=["importing", "engine-starting", "loading"])
def test_ctrl_c_during_startup_stops_at_once(tmp_path: Path, after: str, code: int, said: str) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while `serve` starts: it exits
    within the bound, says so in one line, shows no traceback, and leaves no process behind. The
    model's config.json is a named pipe that no one writes, so the load never ends by itself (as on
    a stalled network mount): a stop that waited for it never ends. Once the engine process is
    started, the signal comes when it exists (it then imports for seconds) or when it loads."""
    model = tmp_path / "stalled"
    model.mkdir()
    os.mkfifo(model / "config.json")
    argv = [*COMMAND, "serve", str(model), "--port", str(_free_port())]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        _lines_until(proc, lambda line: after.format(model=model) in line, LOAD_TIMEOUT_S)
        children = psutil.Process(proc.pid).children(recursive=True) if code else _engine_process(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=CTRL_C_BOUND_S)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, rest
    # One line says so. The only others that may come: the engine process's progress line, when it
    # was already on its way as the signal came, and, on a busy machine where the engine process
    # is still importing past the grace, the line saying it was killed.
    lines = rest.strip().splitlines()
    assert sum(line.endswith(said) for line in lines) == 1, rest
    killed = f"did not stop in {LOAD_CANCEL_GRACE_S:.0f} s; killing it"
    assert all(line.endswith((said, f"loading {model}", killed)) for line in lines), rest
    _, alive = psutil.wait_procs(children, timeout=CTRL_C_BOUND_S)
    assert not alive, alive


def test_chat_keeps_httpx_out_of_the_transcript(demo_dir: Path) -> None:
    """`nanoserve chat --url` at the default log level (INFO): the transcript and stderr hold no
    httpx request line."""
    with serve(make_engine(demo_dir, num_kv_blocks=16, max_model_len=64)) as (url, _):
        done = subprocess.run([*COMMAND, "chat", "--url", url, "--max-tokens", "3", "--temperature", "0"],
                              input="Hi\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Chatting with ") and done.stdout.count(">>> ") == 2
    assert "HTTP Request" not in done.stdout + done.stderr and not done.stderr.strip()
