"""The engine dashboard's data: the block-state record against a KV manager driven by hand, the
engine's stats record and step ring, and the /dashboard/stats stream of a real server on a
loopback port read with httpx (records flow, blocks fill and empty under load, the API key
guards it, and nothing is built while nobody watches)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from nanoserve.engine.args import EngineArgs
from nanoserve.engine.live_stats import LiveStats
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import EngineStats
from nanoserve.engine.sampling_params import SamplingParams
from nanoserve.kv import BlockState, BlockTable, KVCacheManager
from nanoserve.runtime.stand_in import stand_in_engine
from nanoserve.server import ServerConfig, build_app
from nanoserve.server.http_server import ServerThread

from support.server import background_load, make_engine, pace, serve, wait_idle

FREE, USED, CACHED, PINNED = (int(s) for s in BlockState)


def _states(kv: KVCacheManager, *live: BlockTable) -> list[int]:
    """The block states given the live tables, checked against the pool's and the tree's counts
    and against a walk of the whole tree."""
    states = kv.block_states(live)
    counts = np.bincount(states, minlength=4)
    assert counts[FREE] == kv.pool.num_free
    if kv.cache is not None:
        assert counts[CACHED] == kv.cache.evictable_blocks and counts[PINNED] == kv.cache.protected_blocks
        walk = kv.cache.walk()
        assert kv.cache.num_nodes == len(walk)
        for node, _ in walk:
            assert set(states[node.blocks]) <= ({PINNED} if node.lock_ref else {CACHED})
    return states.tolist()


def test_block_states_follow_the_pool_and_the_tree() -> None:
    kv = KVCacheManager(8, 4)
    tokens = list(range(12))
    a = BlockTable()
    assert kv.allocate(a, 10)  # blocks 0, 1, 2
    assert _states(kv, a) == [USED] * 3 + [FREE] * 5
    kv.commit(a, tokens[:10], 10)  # two full blocks published, pinned by a
    assert _states(kv, a) == [PINNED, PINNED, USED] + [FREE] * 5
    kv.free(a, tokens[:10], 10)  # a ends: its cached blocks stay, evictable; its partial block is freed
    assert _states(kv) == [CACHED, CACHED] + [FREE] * 6
    b = BlockTable()
    assert kv.match(b, tokens) == 8 and kv.allocate(b, 12)  # b reuses both and takes a fresh one
    assert _states(kv, b) == [PINNED, PINNED, FREE, USED] + [FREE] * 4
    c = BlockTable()
    assert kv.allocate(c, 8)  # c computes the same prefix on its own: its duplicates stay its own
    kv.commit(c, tokens[:8], 8)
    assert _states(kv, b, c) == [PINNED, PINNED, FREE, USED, USED, USED] + [FREE] * 2
    kv.free(b, tokens, 12)
    assert _states(kv, c) == [PINNED, PINNED, FREE, CACHED, USED, USED] + [FREE] * 2  # b published its third
    kv.free(c, tokens[:8], 8)
    assert _states(kv) == [CACHED, CACHED, FREE, CACHED] + [FREE] * 4
    assert kv.cache is not None and kv.cache.evict(8) == 3
    assert _states(kv) == [FREE] * 8


def test_block_states_without_a_prefix_cache_are_free_or_used() -> None:
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    a = BlockTable()
    assert kv.allocate(a, 9)
    assert _states(kv, a) == [USED] * 3 + [FREE] * 3
    kv.free(a, list(range(9)), 9)
    assert _states(kv) == [FREE] * 6


def test_tree_walk_lists_parents_before_children() -> None:
    kv = KVCacheManager(16, 2)
    for prompt in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9, 9]):
        t = BlockTable()
        assert kv.allocate(t, len(prompt))
        kv.free(t, prompt, len(prompt))
    assert kv.cache is not None
    walk = kv.cache.walk()
    shape = sorted((parent, len(node.blocks)) for node, parent in walk)
    assert shape == [(-1, 1), (0, 1), (0, 1), (1, 1), (1, 1)]  # [1 2] -> {[3 4] -> {[5 6], [7 8]}, [9 9]}
    assert kv.cache.num_nodes == 5
    for i, (node, parent) in enumerate(walk):
        assert parent < i and (parent == -1 or walk[parent][0] is node.parent)
    assert kv.cache.walk(3) == walk[:3]


def test_engine_stats_records_steps_only_while_asked() -> None:
    engine = stand_in_engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 41)), params)  # 40 prompt tokens: two chunks of the budget
    engine.step()
    assert not engine.live_stats.recording and engine.live_stats.record().steps == []
    engine.live_stats.record_steps(True)
    engine.add_request("b", list(range(50, 60)), params)
    while engine.has_unfinished():
        engine.step()
    stats = engine.live_stats.record()
    steps = stats.steps
    assert steps[0].prefill_tokens == 8 + 10 and steps[0].decode_tokens == 0  # a's last chunk, b whole
    assert all(s.decode_tokens == s.num_seqs and s.prefill_tokens == 0 for s in steps[1:])
    assert sum(s.decode_tokens for s in steps) == 5 + 5  # the first token of each came from its prefill
    assert all(s.budget == 32 and s.draft_tokens == 0 and s.duration_s >= 0 for s in steps)
    assert engine.live_stats.record().steps == []  # taken by the previous record
    assert stats.running == [] and stats.waiting == [] and stats.num_waiting_seqs == 0
    assert set(stats.block_states) <= {FREE, CACHED} and len(stats.block_states) == 64
    engine.live_stats.record_steps(False)
    assert not engine.live_stats.recording


def test_engine_stats_lists_sequences_and_the_tree() -> None:
    engine = stand_in_engine(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)
    engine.add_request("b", list(range(1, 9)), params)
    engine.step()
    stats = engine.live_stats.record()
    (run,) = stats.running
    assert (run.request_id, run.prompt_tokens, run.computed_tokens, run.output_tokens) == ("a", 20, 16, 0)
    assert [w.request_id for w in stats.waiting] == ["b"] and stats.num_waiting_seqs == 1
    assert stats.tree_nodes == 1 and stats.tree == [(-1, 4, True)]  # a's four full blocks, pinned by a
    assert list(stats.block_states).count(PINNED) == 4 and list(stats.block_states).count(USED) == 0
    while engine.has_unfinished():
        engine.step()


# ---- the stream, from a real server ----------------------------------------------------------------


def _records(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON records of an SSE stream, checking the framing: `data: <json>` then a blank line."""
    lines = response.iter_lines()
    for line in lines:
        assert line.startswith("data: "), line
        yield json.loads(line[len("data: "):])
        assert next(lines) == ""


def test_dashboard_page_is_served(engine: LLMEngine) -> None:
    with serve(engine) as (url, _):
        r = httpx.get(f"{url}/dashboard")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "dashboard.js" in r.text and "default-src 'none'" in r.headers["content-security-policy"]


def test_blocks_fill_under_load_and_empty_after(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    pace(engine, monkeypatch, 0.02)
    with serve(engine) as (url, app), httpx.stream("GET", f"{url}/dashboard/stats", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        records = _records(r)
        first = next(records)
        assert len(first["blocks"]["states"]) == engine.num_blocks
        assert first["limits"]["max_num_batched_tokens"] == engine.args.max_num_batched_tokens
        assert first["experts"] is None  # a dense model: no expert panel
        load = background_load(url, 8, 32)
        busy: list[dict[str, Any]] = []
        for record in records:
            busy.append(record)
            if not load.is_alive():
                break
        load.join()
        assert max(b["blocks"]["used"] + b["blocks"]["pinned"] for b in busy) > 0
        assert max(len(b["running"]) for b in busy) > 1
        steps = [s for b in busy for s in b["steps"]]
        assert sum(s[3] for s in steps) > 0 and sum(s[5] for s in steps) > 0  # decode and prefill tokens
        assert any(b["rates"] and b["rates"]["generation_tps"] > 0 for b in busy)
        assert any(b["latency"]["ttft"] for b in busy) and any(b["latency"]["itl"] for b in busy)
        wait_idle(app)
        for record in records:  # the records keep coming while idle, and show it
            if record["blocks"]["used"] == 0 and not record["running"] and not record["waiting"]:
                break
        assert record["blocks"]["pinned"] == 0 and record["blocks"]["cached"] > 0  # the prompts stay cached
        assert record["counters"]["generation_tokens"] >= 8 * 32


def test_the_stream_needs_the_api_key(engine: LLMEngine) -> None:
    with serve(engine, api_key="sesame") as (url, _):
        r = httpx.get(f"{url}/dashboard/stats")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/dashboard").status_code == 200  # the page carries no data
        with httpx.stream("GET", f"{url}/dashboard/stats", headers={"Authorization": "Bearer sesame"}) as r:
            assert r.status_code == 200
            assert "blocks" in next(_records(r))


class CountingStats(LiveStats):
    """An engine's live stats that count the records built from them."""

    stats_calls = 0

    def record(self) -> EngineStats:
        self.stats_calls += 1
        return super().record()


def test_nothing_is_built_while_nobody_watches(demo_dir: Path) -> None:
    engine = make_engine(demo_dir)
    engine.live_stats.__class__ = CountingStats
    assert isinstance(engine.live_stats, CountingStats)
    with serve(engine) as (url, app):
        background_load(url, 4, 8).join()
        wait_idle(app)
        assert engine.live_stats.stats_calls == 0 and not engine.live_stats.recording
        for _ in range(2):  # two viewers in turn: each starts the records, each leaves them stopped
            calls = engine.live_stats.stats_calls
            with httpx.stream("GET", f"{url}/dashboard/stats", timeout=30) as r:
                records = _records(r)
                next(records)
                next(records)  # built at least one interval later, by a core still watched
                assert engine.live_stats.stats_calls >= calls + 2 and engine.live_stats.recording
            deadline = time.monotonic() + 10
            while engine.live_stats.recording:  # the server sees the client go and tells the core
                assert time.monotonic() < deadline, "the stats records did not stop"
                time.sleep(0.02)
            calls = engine.live_stats.stats_calls
            background_load(url, 2, 8).join()
            time.sleep(0.5)
            assert engine.live_stats.stats_calls == calls


@pytest.mark.slow
def test_the_stream_from_an_engine_core_process(demo_dir: Path) -> None:
    """The records cross the process boundary (pickled) and an idle core still sends them."""
    args = EngineArgs(model=str(demo_dir), num_kv_blocks=64, max_model_len=128)
    with ServerThread(build_app(args, ServerConfig(served_model_name="demo"))) as server:
        server.wait_healthy(timeout=120)
        with httpx.stream("GET", f"{server.url}/dashboard/stats", timeout=30) as r:
            records = _records(r)
            times = [next(records)["time"] for _ in range(3)]
        assert times == sorted(times) and times[-1] - times[0] >= 0.3  # at most every 0.2 s
