"""Seconds-long runs of every `nanoserve bench` mode through the CLI's main(): throughput (with
--model-shape, peers and rooflines) and serve (against a real server on a loopback port)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nanoserve.bench.roofline import RooflineFractions, fractions, measure_roofline
from nanoserve.bench.shapes import shape_checkpoint, shape_config
from nanoserve.bench.throughput import ThroughputConfig, Workload, format_table
from nanoserve.cli import main
from nanoserve.engine.args import EngineArgs
from nanoserve.model import ModelConfig, load_model
from nanoserve.model.checkpoint.gguf_export import export_gguf
from nanoserve.model.checkpoint.loader import resolve_dtype

from support.forward import full_logits
from support.server import make_engine, serve

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """`--threads` sets torch's global thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


SMALL = ["--num-prompts", "6", "--input-len-range", "4", "24", "--output-len-range", "2", "12"]


def _bench(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict, str]:
    out = tmp_path / "result.json"
    assert main(["--log-level", "WARNING", "bench", "throughput", "--threads", "1", *args, "--json", str(out)]) == 0
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
                       "--output-len-range", "2", "6", "--compare", "sequential")
    for run in result["runs"]:
        _assert_nonzero(run)
    assert result["config"]["model"] == str(demo_dir)
    _, text = _bench(tmp_path, capsys, str(demo_dir), "--num-prompts", "3", "--input-len-range", "4", "12",
                     "--output-len-range", "4", "6", "--no-roofline", "--profile-steps", "2")
    assert "profile of 2 steps after admission (3 requests)" in text and "aten::" in text


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


# --- bench serve, --model-shape, rooflines, peers -----------------------------------------------------------

TINY_SHAPE = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32}


@pytest.fixture(scope="module")
def server_url(demo_dir: Path) -> Iterator[str]:
    """The demo model behind a real server on a loopback port."""
    with serve(make_engine(demo_dir, max_model_len=256, num_kv_blocks=128)) as (url, _):
        yield url


def _serve(tmp_path: Path, url: str, demo_dir: Path, *args: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ["--log-level", "WARNING", "bench", "serve", "--url", url, "--tokenizer", str(demo_dir), *args]
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_serve_concurrency_sweep(tmp_path, capsys, server_url, demo_dir):
    png = tmp_path / "throughput.png"
    result = _serve(tmp_path, server_url, demo_dir, "--num-prompts", "6", "--input-len-range", "4", "16",
                    "--output-len-range", "2", "6", "--max-concurrency", "1", "3", "--plot-throughput", str(png))
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert 12 <= run["output_tokens"] <= 36  # ignore_eos: exactly the lengths asked for
        assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0 and run["total_tokens_per_s"] > 0
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert run[name]["p50"] > 0 and run[name]["p99"] >= run[name]["p50"]
        assert run["e2e_ms"]["p50"] >= run["ttft_ms"]["p50"]
        assert run["prefix_hit_rate"] == 0  # every point of a sweep gets fresh prompts
    assert png.stat().st_size > 0 and "ttft p50" in capsys.readouterr().out


def test_serve_shared_prefix_hits_the_prefix_cache(tmp_path, server_url, demo_dir):
    result = _serve(tmp_path, server_url, demo_dir, "--workload", "shared-prefix", "--prefix-len", "64",
                    "--num-prefixes", "2", "--num-prompts", "6", "--input-len-range", "4", "8",
                    "--output-len-range", "2", "3", "--max-concurrency", "1")
    (run,) = result["runs"]
    assert run["completed"] == 6 and run["shared_fraction"] > 0.5
    assert run["prefix_hit_rate"] >= 0.6 * run["shared_fraction"]  # block granularity: 48 of 64 at worst


def test_serve_multi_turn_chat_at_a_request_rate(tmp_path, server_url, demo_dir):
    png = tmp_path / "ttft.png"
    result = _serve(tmp_path, server_url, demo_dir, "--workload", "multi-turn", "--turns", "2", "--num-prompts", "2",
                    "--input-len-range", "20", "30", "--output-len-range", "2", "4", "--request-rate", "20", "40",
                    "--plot-ttft", str(png))
    assert result["config"]["endpoint"] == "chat" and result["config"]["requests_per_point"] == [4, 4]
    for run in result["runs"]:
        assert run["completed"] == 4 and run["failed"] == 0
        assert run["prefix_hit_rate"] > 0  # the second turn starts with the first
    assert png.stat().st_size > 0


def test_serve_counts_failed_requests(tmp_path, server_url, demo_dir):
    result = _serve(tmp_path, server_url, demo_dir, "--num-prompts", "3", "--input-len-range", "300", "300",
                    "--output-len-range", "2", "2")
    (run,) = result["runs"]
    assert run["completed"] == 0 and run["failed"] == 3 and "HTTP 400" in run["errors"][0]


def test_model_shape_presets_have_the_real_shapes():
    qwen = ModelConfig.from_hf_dict(shape_config("qwen3-0.6b"))
    llama = ModelConfig.from_hf_dict(shape_config("llama-3.2-1b"))
    assert qwen.num_params == 596_049_920 and qwen.vocab_size == 151_936 and qwen.head_dim == 128
    assert llama.num_params == 1_235_814_400 and llama.rope_scaling.rope_type == "llama3"
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_config("gpt-5")


def test_model_shape_checkpoint_through_the_cli(tmp_path, capsys, monkeypatch, demo_dir):
    """A tiny override of the Qwen3-0.6B preset (real vocabulary) runs through `bench throughput
    --model-shape`, with the rooflines printed."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr("nanoserve.model.demo.demo_model_path", lambda: demo_dir)
    overrides = [f"{k}={v}" for k, v in TINY_SHAPE.items()]
    result, text = _bench(tmp_path, capsys, "--model-shape", "qwen3-0.6b", "--shape-override", *overrides,
                          "--num-prompts", "2", "--input-len-range", "4", "8", "--output-len-range", "3", "3")
    path = Path(result["config"]["model"])
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 151_936 and config["hidden_size"] == 64 and path.parent == tmp_path
    assert shape_checkpoint("qwen3-0.6b", TINY_SHAPE) == path  # cached
    _assert_nonzero(result["runs"][0])
    roof = result["roofline"]
    auto_dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # bf16 where the CPU has it
    assert roof["gemm_flops"] > 0 and roof["bandwidth"] > 0 and roof["dtype"] == auto_dtype
    assert roof["runs"]["batched"]["decode_bandwidth"] > 0
    # The decode steps' K/V reads: each step's running sequences' lengths (2 prompts of 4-8 tokens, 3
    # outputs each), at 2 x layers x KV heads x head_dim x the dtype's bytes a position.
    run = result["runs"][0]
    assert run["decode_steps"] * 2 * 5 <= run["decode_context_tokens"] <= run["decode_steps"] * 2 * 10
    kv_bytes = 2 * TINY_SHAPE["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * (
        torch.empty((), dtype=getattr(torch, auto_dtype)).element_size())
    assert roof["kv_bytes_per_token"] == kv_bytes
    assert roof["runs"]["batched"]["decode_bandwidth_kv"] == pytest.approx(
        roof["runs"]["batched"]["decode_bandwidth"] + run["decode_context_tokens_per_s"] * kv_bytes / roof["bandwidth"])
    assert "GEMM peak" in text and "decode % bandwidth, KV incl." in text


def test_roofline_measurement_and_fractions():
    roof = measure_roofline(torch.float32, hidden=64, min_time=0.01)
    assert roof.gemm_flops > 1e8 and roof.bandwidth > 1e8 and roof.matvec_bandwidth > 1e8
    assert roof.fp32_gemm_flops == roof.gemm_flops
    fixed = dataclasses.replace(roof, gemm_flops=1e12, bandwidth=1e10, fp32_gemm_flops=2e12)
    f = fractions(fixed, params=1_000_000, weight_bytes=4_000_000, decode_steps_per_s=100,
                  decode_tokens_per_s=1000, prefill_tokens_per_s=5000)
    assert f == RooflineFractions(decode_bandwidth=0.04, decode_compute=0.002, prefill_compute=0.01,
                                  decode_compute_fp32=0.001)  # no positions counted: no K/V fraction
    with_kv = fractions(fixed, params=1_000_000, weight_bytes=4_000_000, decode_steps_per_s=100,
                        decode_tokens_per_s=1000, prefill_tokens_per_s=5000, decode_context_tokens_per_s=200_000,
                        kv_bytes_per_token=1_000)
    assert with_kv.decode_bandwidth == 0.04 and with_kv.decode_bandwidth_kv == pytest.approx(0.06)


def test_transformers_peers_on_the_demo_model(tmp_path, capsys, demo_dir):
    result, text = _bench(tmp_path, capsys, str(demo_dir), "--num-prompts", "3", "--input-len-range", "4", "12",
                          "--output-len-range", "2", "5", "--peers", "hf-sequential", "hf-static", "hf-cb",
                          "--peer-batch-sizes", "2", "--no-roofline")
    runs = {r["label"]: r for r in result["runs"]}
    assert list(runs) == ["batched", "hf-sequential", "hf-static-2", "hf-cb-2"]
    for run in runs.values():
        _assert_nonzero(run)
        assert run["output_tokens"] == runs["batched"]["output_tokens"] and len(run["latencies"]) == 3
    assert runs["hf-sequential"]["prefill_tokens_per_s"] > 0 and runs["hf-static-2"]["decode_tokens_per_s"] > 0
    assert "batched / hf-static-2 output tok/s" in text and result["roofline"] is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.peers
def test_llama_cpp_reads_our_gguf_with_the_same_logits(tmp_path, make_checkpoint, family):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install .[bench])")
    ckpt = make_checkpoint(family)
    gguf = export_gguf(ckpt, tmp_path / f"{family}.gguf", "F32")
    ids = [5, 17, 300, 42, 7, 99, 1000, 3, 64, 8, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    ours = full_logits(load_model(ckpt, dtype="float32"), [ids])[0]
    f32 = llama_cpp.GGML_TYPE_F32  # an F32 KV cache (llama.cpp's default is F16)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=f32, type_v=f32)
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[: len(ids)])
    llm.close()
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-4, rtol=1e-4), (theirs - ours).abs().max()


@pytest.mark.peers
def test_llama_cpp_peer(tmp_path, capsys, demo_dir):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is optional (pip install .[bench])")
    result, _ = _bench(tmp_path, capsys, str(demo_dir), "--num-prompts", "3", "--input-len-range", "4", "12",
                       "--output-len-range", "3", "5", "--peers", "llama.cpp", "llama.cpp-batch",
                       "--peer-batch-sizes", "2", "--no-roofline")
    ours, single, batched = result["runs"]
    assert single["label"] == "llama.cpp" and batched["label"] == "llama.cpp-batch-2"
    for peer in (single, batched):
        assert peer["output_tokens"] == ours["output_tokens"] and len(peer["latencies"]) == 3
        assert peer["prefill_tokens_per_s"] > 0 and peer["decode_tokens_per_s"] > 0
    assert batched["peak_running"] == 2


@pytest.mark.peers
def test_guidellm_runs_against_our_server(tmp_path, server_url, demo_dir):
    """GuideLLM (offline, with the local tokenizer) completes against nanoserve and reports a
    non-zero output token throughput."""
    if shutil.which("guidellm") is None:
        pytest.skip("guidellm is optional (pip install -c constraints.txt guidellm)")
    out = tmp_path / "guidellm.json"
    cmd = ["guidellm", "run", "--backend", f"kind=openai_http,target={server_url}", "--profile",
           "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=4", "--data",
           "kind=synthetic_text,prompt_tokens=16,output_tokens=4", "--tokenizer",
           f"kind=huggingface_auto,model={demo_dir}", "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__LOGGING__DISABLED": "true"}
    subprocess.run(cmd, check=True, env=env, timeout=120, capture_output=True)
    (bench,) = json.loads(out.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"]["successful"] == 4
    assert bench["metrics"]["output_tokens_per_second"]["successful"]["mean"] > 0


@pytest.mark.parametrize("speculation", [["--speculative-method", "ngram", "--workload", "repeat"],
                                         ["--speculative-model", "DRAFT", "--workload", "chat"],
                                         ["--workload", "edit"], ["--workload", "edit-file"]])
def test_spec_bench(tmp_path, capsys, speculation):
    """`bench spec`: plain and speculative runs alternate, medians are reported with every run's rate,
    the speed-up is the median of the ratios of each pair of runs, and the acceptance figures come
    from the speculative engine (for `edit`, the one given the predictions, whose drafts the
    greedy answers partly accept; for `edit-file`, whose prediction they do not follow)."""
    from nanoserve.model.demo import demo_draft_path

    speculation = [str(demo_draft_path()) if a == "DRAFT" else a for a in speculation]
    out = tmp_path / "spec.json"
    assert main(["--log-level", "WARNING", "bench", "spec", *speculation, "--batch-sizes", "1", "2",
                 "--max-tokens", "8", "--repeats", "2", "--threads", "1", "--max-model-len", "512",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["plain_runs"]) == len(r["spec_runs"]) == 2 and min(r["plain_runs"] + r["spec_runs"]) > 0
        assert sorted(r["plain_runs"])[0] <= r["plain_tok_s"] <= sorted(r["plain_runs"])[-1]
        ratios = [f / p for p, f in zip(r["plain_runs"], r["spec_runs"], strict=True)]  # run pairs, in order
        assert r["speedup"] == pytest.approx(statistics.median(ratios))
        assert r["speedup_range"] == pytest.approx([min(ratios), max(ratios)])
        if "edit-file" in speculation:  # the answer does not follow the file: no drafts proposed
            assert r["acceptance_rate"] == r["mean_accepted_length"] == 0
        else:
            assert 0 <= r["acceptance_rate"] <= 1 and r["mean_accepted_length"] >= 1
        if "edit" in speculation:
            assert r["acceptance_rate"] > 0
    text = capsys.readouterr().out
    assert "repeats=2 (medians)" in text and "speed-up" in text


# --- bench quant -------------------------------------------------------------------------------------------

# Widths that are multiples of 256, so that llama.cpp's Q4_K_M file really holds Q4_K blocks.
QUANT_SHAPE = {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2,
               "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 4096}


def test_bench_quant(tmp_path, capsys, monkeypatch, demo_dir):
    """`bench quant` on a tiny shape: a row per file, both engines' rates, memory and roofline
    fractions sane; llama.cpp and the Q4_K_M file only where llama-cpp-python is installed."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr("nanoserve.model.demo.demo_model_path", lambda: demo_dir)
    llama = importlib.util.find_spec("llama_cpp") is not None
    formats = ["BF16", "Q8_0"] + (["Q4_K_M"] if llama else [])
    engines = ["nanoserve"] + (["llama.cpp"] if llama else [])
    out = tmp_path / "out"
    assert main(["--log-level", "WARNING", "bench", "quant", "--model-shape", "qwen3-0.6b", "--shape-override",
                 *(f"{k}={v}" for k, v in QUANT_SHAPE.items()), "--formats", *(f.lower() for f in formats),
                 "--engines", *engines, "--single-tokens", "4", "--batch-tokens", "3", "--batch-sizes", "2",
                 "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    result = json.loads((out / "quant.json").read_text())
    files = result["files"]
    assert [f["format"] for f in files] == formats and {f["shape"] for f in files} == {"qwen3-0.6b"}
    sizes = [f["file_bytes"] for f in files]
    assert sizes == sorted(sizes, reverse=True)  # BF16 > Q8_0 > Q4_K_M
    assert result["roofline"]["bandwidth"] > 0 and result["machine"]["cpu"]
    for f in files:
        assert list(f["engines"]) == engines and 0 < f["weight_bytes"] <= f["file_bytes"] and f["kv_bytes"] > 0
        for run in f["engines"].values():
            assert len(run["singles"]) == 2 and run["single_decode_tokens_per_s"] > 0
            assert all(s["decode_tokens"] == 3 for s in run["singles"])  # 4 output tokens, the first from prefill
            batch = run["batches"]["2"]
            assert batch["decode_tokens"] == 2 * 2 and batch["decode_tokens_per_s"] > 0 and batch["preemptions"] == 0
            assert run["single_bandwidth_fraction"] > 0
            memory = run["memory"]
            assert 0 < memory["baseline"] <= memory["loaded"] <= memory["peak"]
    text = capsys.readouterr().out
    assert "1-stream ns" in text and "(loaded-base)/(file+KV)" in text and "Q8_0 / BF16 decode tok/s" in text
    assert (out / "quant-qwen3-0.6b.png").stat().st_size > 0
