"""The fused C++ layer ops (`CpuLayerOps`) against the torch reference (`TorchLayerOps`): fp32
against the reference computed in float64; bf16 against the reference in bf16 (the kernels round
wherever torch does), the small-M product against the exact product of its bf16 inputs; odd sizes
that take the scalar tails, threads, refusals; and how the kernel library is built, cached and
selected.

The library is built with the machine's g++ (CI machines have one); on a machine without a compiler
these tests skip, and only then, since selection falls back to torch there."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from nanoserve import kernel_build, native
from nanoserve.model.config import RopeScaling
from nanoserve.model.layer_ops import CpuLayerOps, TorchLayerOps, select_layer_ops
from nanoserve.model.layers import rope_cos_sin, rope_inv_freq
from nanoserve.model.quant.weight_formats import DenseWeight
from nanoserve.native import CSRC, FLAGS, load_cpu_kernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")

REF = TorchLayerOps()
SIZES = [(1, 256), (5, 100), (300, 512)]  # 100: a scalar tail after 12 vectors; 300 x 512: threads engage
BF16_ULP = 2**-7  # relative spacing of bf16 values


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    lib = load_cpu_kernels()
    assert lib is not None, "g++ is installed, so the library must build"
    return CpuLayerOps(lib)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _check_fp32(got: torch.Tensor, inputs_fp32: tuple[torch.Tensor, ...], fn) -> None:
    """`got` (fp32) against `fn` applied by the reference to the same inputs in float64."""
    expected = fn(*(t.double() for t in inputs_fp32))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def _check_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one bf16 rounding step of the bf16 reference (a summation order may flip one), and
    equal almost everywhere (below 1e-30, where exp is clamped, only the bound applies)."""
    assert got.dtype == expected.dtype == torch.bfloat16
    diff = (got.float() - expected.float()).abs()
    assert (diff <= BF16_ULP * expected.float().abs() + 1e-30).all()
    assert (diff[expected.float().abs() > 1e-30] == 0).float().mean() > 0.99


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 130])  # odd m: a last row of x alone, or five rows (vdpbf16ps)
# n: tails of W's row groups; k: a scalar tail; 1100: W row by row, or two rows at a time from 5 rows of x
# (vdpbf16ps)
@pytest.mark.parametrize("n,k", [(1, 8), (7, 100), (130, 256), (9, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(ops, m, n, k, bias):
    x, w = _randn(m, k, seed=20), _randn(n, k, seed=21)
    b = _randn(n, seed=22) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    tol = 1e-5 * max(1, k / 256)  # fp32 rounding of the sum grows with its length
    torch.testing.assert_close(ops.linear(x, DenseWeight(w), b).double(), exact, atol=tol, rtol=tol)
    # bf16 in and out, fp32 accumulation: the exact product of the bf16 inputs, rounded once.
    xb, wb, bb = x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()
    exact = F.linear(xb.double(), wb.double(), None if bb is None else bb.double())
    got = ops.linear(xb, DenseWeight(wb), bb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=2**-8)


def test_the_widening_bf16_loop_too(ops, tmp_path):
    """Where the library multiplies bf16 natively (vdpbf16ps), the widening loop that other CPUs take
    is built too (linear.cpp with -mno-avx512bf16, for the compiler's default x86-64 target: no
    AVX-512 registers) and checked as `test_linear` checks the other, and for batch invariance in
    both dtypes."""
    if not ops.lib.nanoserve_linear_bf16_native():
        pytest.skip("this CPU's build is the widening loop, which test_linear checks")
    path = tmp_path / "widening.so"
    subprocess.run([os.environ.get("CXX", "g++"), *FLAGS, "-mno-avx512bf16", str(CSRC / "linear.cpp"), "-o", str(path)],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(path))
    assert lib.nanoserve_linear_bf16_native() == 0

    def product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        m, n, k = x.shape[0], w.shape[0], x.shape[1]
        out = torch.empty(m, n, dtype=x.dtype)
        fn = lib.nanoserve_linear_bf16 if x.dtype == torch.bfloat16 else lib.nanoserve_linear_f32
        fn(*(ctypes.c_void_p(t.data_ptr()) for t in (x, w, b, out)), ctypes.c_int64(m), ctypes.c_int64(n),
           ctypes.c_int64(k), ctypes.c_int(2))
        return out

    for m, n, k in [(1, 7, 100), (1, 5, 1100), (5, 130, 256), (130, 9, 64), (70, 130, 1100)]:
        x, w, b = _randn(m, k, seed=30), _randn(n, k, seed=31), _randn(n, seed=32)
        got = product(x.bfloat16(), w.bfloat16(), b.bfloat16())
        exact = F.linear(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double())
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=2**-8)
        for dtype in (torch.float32, torch.bfloat16):
            xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
            whole = product(xd, wd, bd)
            rows = torch.cat([product(xd[i:i + 1], wd, bd) for i in range(m)])
            assert torch.equal(rows, whole), (dtype, m, n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# k: short rows; rows of 1,100 values (vdpbf16ps: W a row at a time, two from 5 rows of x on); n: tails of
# W's row groups
@pytest.mark.parametrize("n,k", [(37, 64), (130, 200), (9, 1100)])
def test_linear_rows_do_not_depend_on_the_other_rows(ops, dtype, n, k):
    """Batch invariance: each row of a product is the same bits whatever the number of rows and its
    place among them (130 rows: blocks of 64 rows of x, threads, and groups of 4 or 5 rows), and so
    are the LM head's fp32 logits."""
    x, w = _randn(130, k, seed=27).to(dtype), DenseWeight(_randn(n, k, seed=28).to(dtype))
    for product in (ops.linear, ops.logits):
        whole = product(x, w)
        for rows in (1, 2, 3, 5, 16, 33, 64, 65):
            assert torch.equal(product(x[:rows], w), whole[:rows]), (product.__name__, rows)
        assert torch.equal(torch.cat([product(x[i:i + 1], w) for i in range(x.shape[0])]), whole), product.__name__


def test_logits_are_the_unrounded_fp32_sums(ops):
    """bf16 x and head: fp32 logits, not bf16 ones widened (the products' fp32 sums as they are)."""
    x, w = _randn(3, 256, seed=33).bfloat16(), _randn(500, 256, seed=34).bfloat16()
    got = ops.logits(x, DenseWeight(w))
    assert got.dtype == torch.float32 and not torch.equal(got, got.bfloat16().float())
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.bfloat16(), ops.linear(x, DenseWeight(w)))  # the bf16 product: the same sums, rounded


def test_linear_leaves_odd_inputs_to_torch(ops):
    x, w = _randn(4, 64, seed=23), _randn(32, 64, seed=24)
    w_t = _randn(64, 32, seed=25).t()  # a transposed view: not contiguous
    assert torch.equal(ops.linear(x, DenseWeight(w_t)), F.linear(x, w_t))
    assert torch.equal(ops.linear(x.half(), DenseWeight(w.half())), F.linear(x.half(), w.half()))


@pytest.mark.parametrize("rows,dim", SIZES)
def test_rms_norm(ops, rows, dim):
    x, w = _randn(rows, dim, seed=1, scale=3), _randn(dim, seed=2)
    _check_fp32(ops.rms_norm(x, w, 1e-6), (x, w), lambda x, w: REF.rms_norm(x, w, 1e-6))
    _check_bf16(ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6), REF.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6))


@pytest.mark.parametrize("rows,dim", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_adds_into_the_residual_first(ops, rows, dim, dtype):
    x, w, res = _randn(rows, dim, seed=3).to(dtype), _randn(dim, seed=4).to(dtype), _randn(rows, dim, seed=5).to(dtype)
    res_ref, res_ours = res.clone(), res.clone()
    expected = REF.rms_norm(x, w, 1e-5, res_ref)
    got = ops.rms_norm(x, w, 1e-5, res_ours)
    assert torch.equal(res_ours, res_ref)  # one rounded add, the same on both sides
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        _check_bf16(got, expected)


@pytest.mark.parametrize("rows,inter", [*SIZES, (3, 13)])  # 13: a row shorter than two vectors
def test_silu_mul(ops, rows, inter):
    gate_up = _randn(rows, 2 * inter, seed=6, scale=4)
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30, -200.0])  # exp's clamp and zeros
    _check_fp32(ops.silu_mul(gate_up), (gate_up,), REF.silu_mul)
    _check_bf16(ops.silu_mul(gate_up.bfloat16()), REF.silu_mul(gate_up.bfloat16()))


@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 64, True), (8, 2, 128, False),
                                                             (3, 1, 80, True), (2, 2, 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope(ops, heads, kv_heads, head_dim, qk_norm, dtype):
    """q and k rotated (after their per-head norm) in place in qkv; v's columns untouched."""
    n = 9
    qkv = _randn(n, (heads + 2 * kv_heads) * head_dim, seed=7, scale=2)
    cos, sin = rope_cos_sin(torch.arange(n) * 37 + 5, rope_inv_freq(head_dim, 1e6, RopeScaling()), torch.float64)
    q_w, k_w = (_randn(head_dim, seed=s) if qk_norm else None for s in (8, 9))

    def ref(qkv, cos, sin, q_w, k_w):
        return REF.qk_norm_rope(qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, 1e-6)

    cast = {torch.float32: lambda t: None if t is None else t.float(),
            torch.bfloat16: lambda t: None if t is None else t.bfloat16()}[dtype]
    args = [cast(t) for t in (qkv, cos, sin, q_w, k_w)]
    before = args[0].clone()
    q, k = ops.qk_norm_rope(*args[:3], heads, kv_heads, head_dim, *args[3:], 1e-6)
    assert q.shape == (n, heads, head_dim) and k.shape == (n, kv_heads, head_dim)
    assert q.data_ptr() == args[0].data_ptr()  # in place
    assert torch.equal(args[0][:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])
    if dtype == torch.float32:
        q_ref, k_ref = ref(before.double(), cos, sin, *(None if t is None else t.double() for t in (q_w, k_w)))
        torch.testing.assert_close(q.double(), q_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k.double(), k_ref, atol=1e-5, rtol=1e-5)
    else:
        q_ref, k_ref = ref(before, *args[1:])
        _check_bf16(q, q_ref)
        _check_bf16(k, k_ref)


def test_threads_give_the_same_result(ops):
    x, w, gate_up = _randn(300, 512, seed=10), _randn(512, seed=11), _randn(300, 1024, seed=12)
    xs, ws = _randn(4, 512, seed=13), _randn(1000, 512, seed=14)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((ops.rms_norm(x, w, 1e-6), ops.silu_mul(gate_up), ops.linear(xs, DenseWeight(ws))))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # rows (columns) are independent: the split cannot change a value


def test_refuses_what_it_cannot_read(ops):
    x, w = torch.randn(4, 64), torch.randn(64)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(x.t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        ops.rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="no build"):
        ops.silu_mul(x.half())
    with pytest.raises(ValueError, match="cos/sin"):  # rows for 3 tokens of 4 (narrower ones: partial rotary)
        cos, sin = torch.ones(3, 64), torch.zeros(3, 64)
        ops.qk_norm_rope(torch.randn(4, 4 * 64), cos, sin, 2, 1, 64, None, None, 1e-6)


@pytest.mark.slow
def test_built_once_per_machine_and_source(tmp_path, monkeypatch):
    """The on-demand build (no prebuilt library): compiled once into the cache, then reused. For the
    plain x86-64 flags, whose build (the scalar paths) compiles in seconds: the caching is the same
    for any flags, and the native build is what the other tests load."""
    isa = ("-march=x86-64",)
    lib = load_cpu_kernels(tmp_path, isa=isa, prebuilt=None)
    assert lib is not None
    (built,) = (tmp_path / "kernels").glob("nanoserve_cpu-*.so")
    mtime = built.stat().st_mtime_ns
    runs = []
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: runs.append(a))  # no compiler from here on
    assert load_cpu_kernels(tmp_path, isa=isa, prebuilt=None) is lib  # once per process
    native._load.cache_clear()  # as a new process would: the build on disk is reused
    assert load_cpu_kernels(tmp_path, isa=isa, prebuilt=None) is not None and not runs  # no compiler asked or run
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]  # no temporary left behind
    assert built.stat().st_mtime_ns == mtime


def _declared_entry_points() -> dict[str, tuple[str, int]]:
    """name -> (result type, number of parameters) of every function kernels.h declares."""
    header = re.sub(r"//[^\n]*", "", (CSRC / "kernels.h").read_text())
    return {name: (result, len([p for p in params.split(",") if p.strip()]))
            for result, name, params in re.findall(r"\b(void|int)\s+(nanoserve_\w+)\(([^)]*)\);", header)}


def test_one_signature_table_for_every_entry_point(ops):
    """SIGNATURES covers exactly what kernels.h declares (each source includes the header, so the
    compiler holds the definitions to it), with the declared result and number of parameters, and
    the library was loaded with them."""
    declared = _declared_entry_points()
    assert set(re.findall(r"\bnanoserve_\w+", (CSRC / "kernels.h").read_text())) == set(declared)  # all parsed
    assert len(declared) == 27 and set(native.SIGNATURES) == set(declared)
    for name, (restype, argtypes) in native.SIGNATURES.items():
        assert declared[name] == ("void" if restype is None else "int", len(argtypes)), name
        fn = getattr(ops.lib, name)
        assert fn.restype is restype and tuple(fn.argtypes) == argtypes, name


@pytest.mark.slow
def test_selection(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    for backend in ("auto", "cpu"):
        for dtype in (torch.float32, torch.bfloat16):
            assert isinstance(select_layer_ops(backend, cpu, dtype), CpuLayerOps)
    assert type(select_layer_ops("torch", cpu, torch.float32)) is TorchLayerOps  # the pure-PyTorch path
    assert type(select_layer_ops("auto", cpu, torch.float16)) is TorchLayerOps  # no fp16 build
    assert type(select_layer_ops("auto", torch.device("meta"), torch.float32)) is TorchLayerOps
    # A machine with neither a compiler nor a prebuilt library (the package build's is skipped here).
    monkeypatch.setattr(kernel_build, "prebuilt_library",
                        lambda folder, flags=None: kernel_build.Prebuilt(None, "no prebuilt library here"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path / "empty"))
    assert type(select_layer_ops("auto", cpu, torch.float32)) is TorchLayerOps  # warns, runs on torch
