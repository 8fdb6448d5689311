"""Data parallel: `nanoserve serve --data-parallel-size 2`, two replicas of the demo model behind
sglang-router, started by the one command in a subprocess and driven over loopback; and the
supervisor's pure parts (cpu split, port layout, replica command line, bad input)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from nanoserve import cli
from nanoserve.commands.serve import replica_argv
from nanoserve.server.protocol.errors import APIError
from nanoserve.server.protocol.openai import ChatCompletionRequest, CompletionRequest
from nanoserve.supervisor import data_parallel, processes
from nanoserve.supervisor.data_parallel import DataParallelPlan, free_port_range, split_cpus

from support.server import metric_value

pytestmark = pytest.mark.slow

REPLICA_ARGS = ["--served-model-name", "nanoserve-demo", "--max-model-len", "1024", "--num-kv-blocks", "256",
                "--shutdown-timeout", "2"]


@dataclass
class Launched:
    proc: subprocess.Popen[bytes]
    url: str
    replicas: tuple[str, ...]
    log: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def replica_pid(self, i: int) -> int:
        """The pid of replica i's server process (a child of the supervisor, found by its port)."""
        port = self.replicas[i].rsplit(":", 1)[1]
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and port.encode() in argv:
                return int(pid)
        raise AssertionError(f"no replica on port {port} among {children}")


@contextlib.contextmanager
def launched(demo_dir: Path, tmp_path: Path, policy: str, api_key: str | None = None) -> Iterator[Launched]:
    """The one command in a subprocess; `api_key` given through $NANOSERVE_API_KEY."""
    port = free_port_range(4)
    log = tmp_path / f"dp-{policy}.log"
    cmd = [sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", str(demo_dir), "--port",
           str(port), "--data-parallel-size", "2", "--router-policy", policy, *REPLICA_ARGS]
    with log.open("wb") as out:
        env = {**os.environ, "NANOSERVE_API_KEY": api_key or ""}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    replicas = (f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}")
    up = Launched(proc, f"http://127.0.0.1:{port}", replicas, log, api_key)
    try:
        deadline = time.monotonic() + 90
        while not _ready(up.url):
            assert proc.poll() is None, f"the supervisor exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not up in time:\n{log.read_text()}"
            time.sleep(0.2)
        yield up
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        assert status == 0, log.read_text()
    for url in up.replicas:  # the supervisor took its replicas down with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")


def _ready(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError, ValueError):
        return httpx.get(f"{url}/readiness", timeout=2).json().get("healthy_workers") == 2
    return False


def _chat(up: Launched, system: str, question: str, max_tokens: int = 1) -> int:
    body = {"model": "nanoserve-demo", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return httpx.post(f"{up.url}/v1/chat/completions", json=body, headers=up.headers, timeout=60).status_code


def _prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, prompt tokens found) in a replica's prefix cache, from /metrics."""
    page = httpx.get(f"{url}/metrics").text
    return (metric_value(page, "nanoserve:prefix_cache_queries_total"),
            metric_value(page, "nanoserve:prefix_cache_hits_total"))


def _system_prompts(groups: int) -> list[str]:
    """Long system prompts (~450 tokens) that share no prefix with each other, not even a word."""
    rng = random.Random(7)
    words = ("river", "stone", "cloud", "apple", "garden", "window", "music", "winter", "candle", "forest")
    return [f"{g}{g} " + " ".join(rng.choice(words) for _ in range(300)) for g in range(groups)]


def _hit_rates(up: Launched) -> tuple[float, list[float]]:
    """Sends 6 rounds of 3 requests, one per group of requests sharing a system prompt; a round's
    requests start 50 ms apart, in the same order every round, and overlap (64 tokens each).
    Returns the replicas' pooled prefix-cache hit rate and each one's lookups."""
    systems = _system_prompts(3)
    with concurrent.futures.ThreadPoolExecutor(len(systems)) as pool:
        for q in range(6):
            running = []
            for system in systems:
                running.append(pool.submit(_chat, up, system, f"question {q}: what is {q} plus {q}?", 64))
                time.sleep(0.05)
            assert [f.result() for f in running] == [200] * len(systems)
    counters = [_prefix_counters(u) for u in up.replicas]
    return sum(h for _, h in counters) / sum(q for q, _ in counters), [q for q, _ in counters]


def test_cache_aware_routing_finds_each_system_prompt_cached(demo_dir: Path, tmp_path: Path) -> None:
    """Round robin sends a group's requests to the two replicas in turn (3 groups, 2 replicas), so
    each group's system prompt is computed on both; cache_aware keeps a group on the replica that
    has its prompt (a new prompt goes to the least loaded one, so both replicas get work). Hit
    rates: 5 of a group's 6 prompts cached under cache_aware, 4 of 6 under round robin."""
    with launched(demo_dir, tmp_path, "cache_aware", api_key="sk-dp") as up:
        aware, aware_lookups = _hit_rates(up)
        _check_the_api_key(up)
        models = httpx.get(f"{up.url}/v1/models", headers=up.headers).json()["data"]
        assert [m["id"] for m in models] == ["nanoserve-demo"]  # learnt from the replicas' /server_info
    with launched(demo_dir, tmp_path, "round_robin") as up:
        robin, robin_lookups = _hit_rates(up)
    assert all(n > 0 for n in aware_lookups + robin_lookups), (aware_lookups, robin_lookups)
    assert aware > 0.75, (aware, robin)
    assert aware - robin > 0.1, (aware, robin)


def _check_the_api_key(up: Launched) -> None:
    """The router refuses a request without the key (its worker management too), and the key is on
    no command line of the supervisor's children."""
    body = {"model": "nanoserve-demo", "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{up.url}/v1/completions", json=body).status_code == 401
    assert httpx.post(f"{up.url}/v1/completions", json=body, headers={"Authorization": "Bearer no"}).status_code == 401
    assert httpx.get(f"{up.url}/workers").status_code == 401
    assert httpx.post(f"{up.replicas[0]}/v1/completions", json=body).status_code == 401
    children = Path(f"/proc/{up.proc.pid}/task/{up.proc.pid}/children").read_text().split()
    assert len(children) == 3  # two replicas and the router
    assert all(b"sk-dp" not in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children)


def test_a_replica_killed_mid_load_leaves_the_other_serving(demo_dir: Path, tmp_path: Path) -> None:
    """SIGKILL to one replica while 8 requests run: the ones on it may fail (the router retries
    those that have not answered yet); every request after it succeeds, and the supervisor stays up."""
    systems = _system_prompts(4)
    with launched(demo_dir, tmp_path, "cache_aware") as up:
        victim = up.replica_pid(1)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            running = [pool.submit(_chat, up, systems[i % 4], f"tell me story {i}", 200) for i in range(8)]
            deadline = time.monotonic() + 30
            while _prefix_counters(up.replicas[1])[0] == 0:  # the victim has work in flight
                assert time.monotonic() < deadline, "no request reached replica 1"
                time.sleep(0.05)
            os.kill(victim, signal.SIGKILL)
            in_flight = [f.exception() or f.result() for f in running]
        assert in_flight.count(200) >= 4, in_flight  # at least the other replica's requests
        after = [_chat(up, systems[i % 4], f"and now {i}", 4) for i in range(12)]
        assert after == [200] * 12
        assert up.proc.poll() is None
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{up.replicas[1]}/health")
        assert httpx.get(f"{up.replicas[0]}/health").status_code == 200


def test_the_cores_are_split_into_contiguous_groups() -> None:
    assert split_cpus([0, 1, 2, 3], 2) == ((0, 1), (2, 3))
    assert split_cpus([0, 1, 2, 3, 4], 2) == ((0, 1, 2), (3, 4))
    assert split_cpus([4, 5], 1) == ((4, 5),)
    assert split_cpus([0, 1], 3) == ((0,), (1,), (0,))  # more replicas than cores: shared in turn


def test_the_port_layout_and_its_limits() -> None:
    plan = DataParallelPlan.for_cpus("0.0.0.0", 8000, 2, "cache_aware", [0, 1])
    assert plan.replica_urls == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert plan.metrics_port == 8003 and plan.local_url == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="pick a port at most 65532"):
        DataParallelPlan.for_cpus("127.0.0.1", 65534, 2, "cache_aware", [0, 1])
    with pytest.raises(ValueError, match="a port of 1 or more"):
        DataParallelPlan.for_cpus("127.0.0.1", 0, 2, "cache_aware", [0, 1])


@pytest.mark.parametrize("size", ["0", "-2"])
def test_a_data_parallel_size_below_1_is_an_error(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--data-parallel-size", size]) == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_data_parallel_with_tensor_parallel_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--data-parallel-size", "2", "--tensor-parallel-size", "2"]) == 2
    assert "--data-parallel-size with --tensor-parallel-size" in capsys.readouterr().err


def test_a_port_of_the_layout_in_use_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port_range(4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        taken.listen()
        assert cli.main(["serve", "--port", str(port), "--data-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"port {port + 2} on 127.0.0.1 is not free" in err and "pick another --port" in err


def test_a_missing_router_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name))
    assert cli.main(["serve", "--port", str(free_port_range(4)), "--data-parallel-size", "2"]) == 2
    assert "pip install 'nanoserve[router]'" in capsys.readouterr().err


def test_a_replica_gets_every_flag_but_the_supervisors() -> None:
    parser = cli.build_parser()
    argv = ["serve", "some/model", "--port", "9000", "--host", "0.0.0.0", "--data-parallel-size", "3",
            "--router-policy", "round_robin", "--api-key", "k", "--allowed-origins", "a", "b",
            "--no-enable-prefix-caching", "--max-num-seqs", "7", "--kv-cache-memory", "1000"]
    ns = parser.parse_args(argv)
    flags = replica_argv(ns.serve_parser, ns)
    assert not {"--port", "--host", "--data-parallel-size", "--router-policy"} & set(flags)
    again = parser.parse_args(["serve", *flags, "--port", "9001"])
    skip = {"port", "host", "data_parallel_size", "router_policy", "serve_parser", "func"}
    assert {k: v for k, v in vars(again).items() if k not in skip} == {
        k: v for k, v in vars(ns).items() if k not in skip}


def test_the_routers_extra_fields_are_accepted_at_their_defaults_only() -> None:
    """sglang-router writes SGLang's extras into every request it forwards (these values)."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "no_stop_trim": False, "return_hidden_states": False,
            "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}
    ChatCompletionRequest.model_validate(chat).sampling_params(4, None)
    CompletionRequest.model_validate({"prompt": "hi", "no_stop_trim": False,
                                      "return_hidden_states": False}).sampling_params(4, None)
    for field, value in [("no_stop_trim", True), ("continue_final_message", True), ("separate_reasoning", False)]:
        with pytest.raises(APIError) as e:
            ChatCompletionRequest.model_validate({**chat, field: value}).sampling_params(4, None)
        assert e.value.param == field


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


@pytest.mark.parametrize(("router_s", "replica_s", "signalled", "status"), [
    (60, 60, True, 0),  # a signal: exit 0
    (0, 60, False, 1),  # the router died: exit 1
    (60, 0, False, 1),  # every replica died: exit 1
])
def test_the_supervisor_ends_on_a_signal_or_when_serving_is_over(router_s: float, replica_s: float,
                                                                   signalled: bool, status: int) -> None:
    router, replicas = _sleeper(router_s), [_sleeper(replica_s), _sleeper(replica_s)]
    stopping = threading.Event()
    if signalled:
        threading.Timer(0.5, stopping.set).start()
    try:
        assert data_parallel.supervise(router, replicas, stopping) == status
    finally:
        processes.stop([router, *replicas], 5)
