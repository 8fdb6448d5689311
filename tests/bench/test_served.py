"""`nanoserve bench serve --peer llama-server` end to end on the demo model's GGUF, a few tokens at
concurrency 1 and 2: real `nanoserve serve` processes on loopback ports, the real load client, and
llama-server where the cache holds its build (absent: that test skips and says why)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import gguf
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from nanoserve.bench.llama_server import built_binary, server_command
from nanoserve.bench.serve import LoadConfig, send
from nanoserve.bench.served import LLAMA_SERVER, NANOSERVE, ModelFile, ServedConfig, _server_argv, run_served
from nanoserve.cli import main
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.server.http_server import ServerThread

pytestmark = pytest.mark.slow

PROMPT, OUTPUT, REQUESTS = 8, 4, 3


def _free_port_pair() -> int:
    """A port p with p and p + 1 free now (the servers take consecutive ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def demo_gguf(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_gguf(demo_dir, tmp_path_factory.mktemp("served") / "demo-Q8_0.gguf", "Q8_0")


def _config(gguf: Path, servers: tuple[str, ...]) -> ServedConfig:
    return ServedConfig(models=(str(gguf),), concurrency=(1, 2), num_prompts=(REQUESTS,), lengths=(PROMPT, OUTPUT),
                        threads=1, port=_free_port_pair(), servers=servers, roofline=False)


def _check_runs(report_dict: dict, servers: tuple[str, ...]) -> None:
    points = report_dict["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        assert set(p["runs"]) == set(servers)
        for run in p["runs"].values():
            assert run["completed"] == REQUESTS and run["failed"] == 0, run["errors"]
            assert run["output_tokens"] == REQUESTS * OUTPUT and run["prompt_tokens"] == REQUESTS * PROMPT
            assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
            assert run["tpot_ms"]["p50"] > 0


def test_prompts_are_normal_tokens_of_the_file(demo_gguf: Path) -> None:
    model = ModelFile.read("demo", demo_gguf)
    reader = gguf.GGUFReader(demo_gguf)
    types = reader.fields["tokenizer.ggml.token_type"]
    control = [i for i, idx in enumerate(types.data) if int(types.parts[idx][0]) == int(gguf.TokenType.CONTROL)]
    assert control and not set(control) & set(model.normal_ids)
    assert model.params > 0 and 0 < model.weight_bytes < demo_gguf.stat().st_size


def test_nanoserve_half(demo_gguf: Path, tmp_path: Path) -> None:
    """The orchestration with nanoserve alone: servers started, driven, table and JSON, stopped."""
    cfg = _config(demo_gguf, (NANOSERVE,))
    report = run_served(cfg, tmp_path / "logs", progress=False)
    data = json.loads(json.dumps(report.to_dict()))
    _check_runs(data, (NANOSERVE,))
    assert "nanoserve tok/s" in report.format() and "/llama-server" not in report.format()
    with socket.socket() as s:  # the server was stopped: its port is free again
        s.bind(("127.0.0.1", cfg.port))


def test_each_tree_serves_its_own_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A labelled tree's server imports that tree's nanoserve, even when the benchmark runs from
    inside another checkout (`python -m` puts the working directory ahead of PYTHONPATH). The stand-in
    tree's `nanoserve.cli` only prints where it was imported from."""
    tree = tmp_path / "other-tree"
    (tree / "nanoserve").mkdir(parents=True)
    (tree / "nanoserve" / "__init__.py").write_text("")
    (tree / "nanoserve" / "cli.py").write_text("print(__file__)\n")
    monkeypatch.chdir(Path(__file__).parents[2])  # this checkout, whose nanoserve is importable from here
    cfg = ServedConfig(models=("m.gguf",), nanoserve_trees={"other": tree}, servers=("other",), roofline=False)
    argv, env, cwd = _server_argv(cfg, "other", Path("m.gguf"), 9000, None)
    ran = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True, timeout=60)
    assert Path(ran.stdout.strip()).resolve() == (tree / "nanoserve" / "cli.py").resolve()


def test_llama_server_command_line(tmp_path: Path) -> None:
    cmd = server_command(Path("/bin/llama-server"), tmp_path / "m.gguf", 9000, 4, 100, 2, no_repack=True)
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert flags["-np"] == "4" and flags["-c"] == "400" and flags["-t"] == "2" and cmd[-1] == "--no-repack"
    assert "--no-repack" not in server_command(Path("x"), Path("m"), 1, 1, 1, 1, no_repack=False)


def test_flags_the_peer_run_does_not_honour_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--peer", "llama-server", "--workload", "multi-turn"]) == 2
    assert "--workload not used with --peer" in capsys.readouterr().err
    assert main(["bench", "serve", "--peer", "llama-server", "--input-len-range", "8", "16"]) == 2
    assert "MIN = MAX" in capsys.readouterr().err
    assert main(["bench", "serve", "--models", "x.gguf", "--url", "http://127.0.0.1:1"]) == 2
    assert "--models only apply with --peer" in capsys.readouterr().err
    assert main(["bench", "serve"]) == 2
    assert "give --url" in capsys.readouterr().err
    assert main(["bench", "serve", "--peer", "none", "--nanoserve-flags", "b=--prefill-order shared"]) == 2
    assert "--nanoserve-flags for ['b'], which name no nanoserve tree" in capsys.readouterr().err
    assert main(["bench", "serve", "--peer", "none", "--nanoserve-tree", "a"]) == 2
    assert "--nanoserve-tree needs LABEL=PATH" in capsys.readouterr().err


@pytest.mark.peers
def test_against_llama_server(demo_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if built_binary() is None:
        pytest.skip("llama-server is not built in $NANOSERVE_CACHE/llama-server (`nanoserve bench serve --peer "
                    "llama-server` builds it, minutes on 2 cores)")
    out = tmp_path / "served.json"
    assert main(["bench", "serve", "--peer", "llama-server", "--models", str(demo_gguf), "--max-concurrency", "1",
                 "2", "--num-prompts", str(REQUESTS), "--input-len-range", str(PROMPT), str(PROMPT),
                 "--output-len-range", str(OUTPUT), str(OUTPUT), "--threads", "1", "--port", str(_free_port_pair()),
                 "--no-roofline", "--json", str(out), "--plot-throughput", str(tmp_path / "served.png")]) == 0
    _check_runs(json.loads(out.read_text()), (NANOSERVE, LLAMA_SERVER))
    assert "nanoserve/llama-server" in capsys.readouterr().out
    assert (tmp_path / "served.png").stat().st_size > 0


def test_the_client_reads_raw_unicode_line_separators_inside_events() -> None:
    """A server may write U+2028 / U+2029 / U+0085 raw inside an event's JSON (valid JSON; nanoserve
    escapes them, others need not): the benchmark's client splits the stream at line feeds only, so
    such a request completes with its text instead of failing with a JSONDecodeError."""
    text = ["a\u2028b", "c\u2029d", "e\x85f"]

    async def completions(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for piece in text:
                payload = {"choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                yield b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\r\n\r\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with ServerThread(app) as server:
        async def one() -> str:
            async with httpx.AsyncClient(base_url=server.url) as client:
                res = await send(client, LoadConfig(url=server.url, label="raw"), {"prompt": "x"}, len)
            assert not res.error, res.error
            return res.text
        assert asyncio.run(one()) == "".join(text)
