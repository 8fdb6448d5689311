"""Seconds-long runs of every `nanoserve bench throughput` mode, through the CLI's main()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanoserve.bench.throughput import ThroughputConfig, Workload, format_table
from nanoserve.cli import main
from nanoserve.engine.args import EngineArgs

SMALL = ["--num-prompts", "6", "--input-len-range", "4", "24", "--output-len-range", "2", "12"]


def _bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    assert main(["--log-level", "WARNING", "bench", "throughput", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _assert_nonzero(run: dict) -> None:
    for name in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "steps_per_s", "elapsed_s"):
        assert run[name] > 0, name
    assert run["peak_running"] >= 1 and run["output_tokens"] >= run["requests"]


def test_stand_in_batched(tmp_path, capsys):
    result, text = _bench(tmp_path, capsys, "--stand-in", *SMALL, "--max-num-seqs", "8")
    (run,) = result["runs"]
    _assert_nonzero(run)
    assert run["requests"] == 6 and run["peak_running"] == 6
    assert run["decode_tokens"] > 0 and run["decode_tokens_per_s"] > 0
    assert "output tok/s" in text and "batched" in text and "model=stand-in" in text


def test_stand_in_compare_sequential(tmp_path, capsys):
    result, text = _bench(tmp_path, capsys, "--stand-in", *SMALL, "--compare", "sequential")
    batched, sequential = result["runs"]
    _assert_nonzero(batched)
    _assert_nonzero(sequential)
    assert sequential["peak_running"] == 1 and batched["output_tokens"] == sequential["output_tokens"]
    assert result["ratio"] > 0 and "batched / sequential output tok/s" in text


def test_stand_in_compare_contiguous(tmp_path, capsys):
    result, text = _bench(tmp_path, capsys, "--stand-in", "--num-prompts", "24", "--input-len-range", "8", "32",
                          "--output-len-range", "4", "16")
    assert result["compare"] is None
    result, text = _bench(tmp_path, capsys, "--stand-in", "--num-prompts", "24", "--input-len-range", "8", "32",
                          "--output-len-range", "4", "16", "--compare", "contiguous")
    paged, contiguous = result["runs"]
    _assert_nonzero(paged)
    _assert_nonzero(contiguous)
    assert contiguous["peak_running"] == 8  # the default pool holds 8 sequences of max_model_len 2048
    assert paged["peak_running"] == 24 and result["ratio"] == 3.0
    assert "max_model_len=2048" in text and "paged / contiguous peak running sequences: 3.00x" in text


def test_demo_model_compare_sequential(tmp_path, capsys, demo_dir):
    result, _ = _bench(tmp_path, capsys, str(demo_dir), "--num-prompts", "3", "--input-len-range", "4", "12",
                       "--output-len-range", "2", "6", "--compare", "sequential", "--threads", "1")
    for run in result["runs"]:
        _assert_nonzero(run)
    assert result["config"]["model"] == str(demo_dir)


def test_bad_arguments_are_reported():
    assert main(["bench", "throughput", "--stand-in", "--input-len-range", "9", "3", "--num-prompts", "1"]) == 2
    with pytest.raises(ValueError, match="--stand-in"):
        ThroughputConfig(EngineArgs(model="some/model"), stand_in=True)


def test_workload_is_reproducible_and_in_range():
    a = Workload.random(20, (3, 9), (1, 4), vocab_size=50, seed=7)
    assert a == Workload.random(20, (3, 9), (1, 4), vocab_size=50, seed=7)
    assert a != Workload.random(20, (3, 9), (1, 4), vocab_size=50, seed=8)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a.prompts)
    assert all(1 <= n <= 4 for n in a.output_lens)


def test_format_table_aligns_columns():
    lines = format_table(["run", "tok/s"], [["a", "1.0"], ["longer", "123.4"]]).splitlines()
    assert lines == ["run     tok/s", "------  -----", "a         1.0", "longer  123.4"]
