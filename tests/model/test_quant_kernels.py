"""quant.cpp's products and row dequantization against gguf-py's dequantizer (an independent
implementation of the GGUF block formats), for every format, on every instruction set path this CPU
can run: the native build and, where the CPU has VNNI, builds without it (AVX2) and without AVX2
(scalar).

Tolerance of the products (derived, not fitted): quant.cpp quantizes each activation row in blocks
of 32 with dx = amax / 127 and q = round(x / dx), so each activation moves by at most dx / 2 =
amax / 254 (times 1.001 for the fp32 rounding of dx and 1 / dx); the product then moves by at most
sum_k |W[n, k]| * amax(k's block) / 254. For the k-quants but iq4_xs (their super-blocks summed in
int32) a block's dx is rounded up to a whole multiple of amax(its 256 values) / (127 * 32), so
amax(k's block) + amax(k's 256) / 32 takes the place of amax(k's block). On top: fp32
accumulation, 1e-5 * sum |W| |x|, and for bf16 outputs half an ulp of bf16 (2^-8 relative). The
scalar path (no activation quantization) is held to the same bound.
"""

from __future__ import annotations

import ctypes

import gguf.quants
import numpy as np
import pytest
import torch

from nanoserve.kernel_build import cpu_flags
from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.quant.block_quant import (
    BLOCK_FORMATS,
    BlockQuantWeight,
    QuantizedRows,
    StackedWeight,
    dequantize,
    quantize,
)
from nanoserve.model.quant.weight_formats import DenseWeight
from nanoserve.native import load_cpu_kernels
from tests.support.kernel_builds import BUILD_PARAMS, load_build, needs_compiler

FORMATS = list(BLOCK_FORMATS)
# Byte offsets of each format's fp16 scales within a block.
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "iq4_nl": (0,),
                 "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "iq4_xs": (0,), "q3_k": (108,),
                 "q2_k": (80, 82)}
# (M, N, K in blocks): odd N, K with an odd number of 32-value blocks, M across the row-group tails;
# the product at index i runs on 1 + i % 2 threads. (1, 301, 23): one row of x over five tasks of
# columns shared by two threads in every format (enough multiply-adds to go parallel even with
# 32-value blocks), W's rows in pairs (the k-quants on Intel cores) and an odd one at the end.
SHAPES = [(1, 1, 1), (1, 7, 3), (1, 13, 4), (2, 9, 2), (3, 33, 5), (4, 8, 4), (5, 67, 3), (7, 5, 8), (16, 64, 4),
          (33, 19, 6), (64, 130, 2), (1, 301, 23)]
ISA_NAMES = {3: "AVX512-VNNI", 2: "AVX-VNNI", 1: "AVX2", 0: "scalar"}
# The formats whose activation scales are steps of their 256 values' (quant_dot.h's superblock_dot).
SUPERBLOCK_FORMATS = {"q4_k", "q5_k", "q6_k", "q3_k", "q2_k"}


# The native build is the fast tier's; of the builds for older instruction sets, the AVX2 one is the package
# build's variant (prebuilt at install) and the scalar one is compiled once into the on-disk cache.
@pytest.fixture(scope="module", params=BUILD_PARAMS)
def build(request: pytest.FixtureRequest) -> tuple[str, ctypes.CDLL]:
    return request.param, load_build(request.param)


@pytest.fixture
def lib(build: tuple[str, ctypes.CDLL]) -> ctypes.CDLL:
    return build[1]


@pytest.mark.slow
def test_each_build_runs_the_path_its_flags_select(build: tuple[str, ctypes.CDLL]) -> None:
    name, lib = build
    flags = cpu_flags()
    native = 3 if {"avx512_vnni", "avx512bw", "avx512dq"} <= flags else (
        2 if "avx_vnni" in flags else (1 if "avx2" in flags else 0))
    expected = {"native": native, "no-vnni": 1, "no-avx2": 0}[name]
    assert lib.nanoserve_quant_isa() == expected, ISA_NAMES[lib.nanoserve_quant_isa()]
    # The AMX tiles: in the native build where this CPU has them (the older ISAs' builds have none).
    assert lib.nanoserve_quant_amx() == (name == "native" and amx_granted())


def amx_granted() -> bool:
    """Whether this CPU has AMX-INT8 and Linux lets this process use it (ARCH_REQ_XCOMP_PERM for
    XTILEDATA, which the kernels ask too; asking again is harmless)."""
    if not {"amx_tile", "amx_int8"} <= cpu_flags():
        return False
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64
    return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0


def test_the_installed_kernels_take_amx_tiles_where_the_cpu_has_them() -> None:
    """The library nanoserve loads (the package build's AVX512 variant here, or a build for this CPU)
    runs the superblock formats' many-row products on AMX-INT8 tiles exactly where the CPU has them
    and the OS grants them: so on such a machine the batch invariance and accuracy tests below
    check that path, and elsewhere the AVX512-VNNI / AVX2 micro-kernel (quant_panel.h)."""
    lib = load_cpu_kernels()
    assert lib is not None
    assert lib.nanoserve_quant_amx() == amx_granted()


def random_blocks(fmt: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks: random bytes, fp16 scales in +-[0.001, 0.02], q8_0 quants in [-127, 127]
    (as ggml's quantizers write them)."""
    spec = BLOCK_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, spec.row_bytes(in_features)), dtype=np.uint8)
    blocks = raw.reshape(-1, spec.type_size)
    for at in SCALE_OFFSETS[fmt]:
        scales = rng.uniform(0.001, 0.02, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
        blocks[:, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if fmt == "q8_0":
        quants = blocks[:, 2:].view(np.int8)
        quants[quants == -128] = -127
    return raw


def reference(raw: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, BLOCK_FORMATS[fmt].qtype).astype(np.float32))


def _block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| of each value's block of `block` values, in its place."""
    return x.abs().reshape(x.shape[0], -1, block).amax(dim=2, keepdim=True).expand(-1, -1, block).reshape(x.shape)


def bound(w: torch.Tensor, x: torch.Tensor, superblock: bool = False) -> torch.Tensor:
    """The derived tolerance of each output of x w^T, x quantized per 32 values (`superblock`: on
    the steps of its 256 values' scale; see the module docstring)."""
    amax = _block_max(x, 32) + (_block_max(x, 256) / 32 if superblock else 0)
    step = amax / 254 * 1.001
    return step @ w.abs().T + 1e-5 * (x.abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_within_the_activation_quantization_bound(lib: ctypes.CDLL, fmt: str,
                                                               dtype: torch.dtype) -> None:
    rng = np.random.default_rng(2 * FORMATS.index(fmt) + (dtype == torch.bfloat16))
    spec = BLOCK_FORMATS[fmt]
    fn = getattr(lib, f"nanoserve_quant_linear_{'f32' if dtype == torch.float32 else 'bf16'}")
    for i, (m, n, kb) in enumerate(SHAPES):
        k = kb * spec.block_size
        raw = random_blocks(fmt, n, k, rng)
        w = reference(raw, fmt)
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        x[:, : k // 3] *= 20  # blocks of very different magnitudes
        with_bias = i % 2 == 0
        bias = torch.randn(n).to(dtype) if with_bias else None
        stride = n + 3 * (i % 3)  # columns [0, n) of a wider output
        out = torch.full((m, stride), 7.0, dtype=dtype)
        assert fn(x.data_ptr(), raw.ctypes.data, int(spec.qtype), None if bias is None else bias.data_ptr(),
                  out.data_ptr(), stride, m, n, k, 1 + i % 2) == 1
        ref = x.float() @ w.T + (0 if bias is None else bias.float())
        tol = bound(w, x.float(), fmt in SUPERBLOCK_FORMATS) + (ref.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
        err = (out[:, :n].float() - ref).abs()
        assert (err <= tol).all(), f"{fmt} {dtype} M={m} N={n} K={k}: max excess {(err - tol).max().item()}"
        assert (out[:, n:] == 7.0).all(), "wrote outside its column slice"


def test_quant_linear_refuses_what_it_does_not_take(lib: ctypes.CDLL) -> None:
    out = torch.zeros(1, 4)
    x = torch.zeros(1, 100)
    raw = np.zeros((4, 200), dtype=np.uint8)
    assert lib.nanoserve_quant_linear_f32(x.data_ptr(), raw.ctypes.data, 8, None, out.data_ptr(), 4, 1, 4, 100, 1) == 0
    assert lib.nanoserve_quant_linear_f32(x.data_ptr(), raw.ctypes.data, 1, None, out.data_ptr(), 4, 1, 4, 64, 1) == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_is_gguf_dequantize(lib: ctypes.CDLL, fmt: str) -> None:
    """Every value as ggml computes it, bit for bit in fp32 (and rounded once to bf16); gathered rows
    are the indexed rows; an index out of range writes nothing."""
    rng = np.random.default_rng(1)
    spec = BLOCK_FORMATS[fmt]
    k = 2 * 256
    raw = random_blocks(fmt, 9, k, rng)
    ref = reference(raw, fmt)
    out = torch.empty(9, k)
    assert lib.nanoserve_dequantize_rows_f32(raw.ctypes.data, int(spec.qtype), 9, k, None, 9, out.data_ptr(), 2) == 1
    assert torch.equal(out, ref)
    rows = torch.tensor([8, 0, 3, 3], dtype=torch.int64)
    gathered = torch.empty(4, k, dtype=torch.bfloat16)
    assert lib.nanoserve_dequantize_rows_bf16(raw.ctypes.data, int(spec.qtype), 9, k, rows.data_ptr(), 4,
                                              gathered.data_ptr(), 1) == 1
    assert torch.equal(gathered, ref[rows].to(torch.bfloat16))
    bad = torch.tensor([0, 9], dtype=torch.int64)
    untouched = torch.zeros(2, k)
    assert lib.nanoserve_dequantize_rows_f32(raw.ctypes.data, int(spec.qtype), 9, k, bad.data_ptr(), 2,
                                             untouched.data_ptr(), 1) == -1
    assert not untouched.any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_dequantize_is_gguf_dequantize(fmt: str) -> None:
    rng = np.random.default_rng(2)
    raw = random_blocks(fmt, 5, 512, rng)
    rows = QuantizedRows(fmt, torch.from_numpy(raw), 512)
    assert torch.equal(dequantize(rows), reference(raw, fmt))
    assert torch.equal(dequantize(rows[torch.tensor([4, 1])]), reference(raw, fmt)[[4, 1]])
    assert torch.equal(dequantize(rows[1:3]), reference(raw, fmt)[1:3])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantize_is_ggml_reference_quantizer(fmt: str) -> None:
    x = torch.randn(6, 96) * torch.logspace(-3, 2, 6)[:, None]
    x[2, :32] = 0  # an all-zero block
    ours = quantize(x, fmt).numpy()
    assert np.array_equal(ours, gguf.quants.quantize(x.numpy(), BLOCK_FORMATS[fmt].qtype))
    w = BlockQuantWeight.empty(fmt, 6, 96)
    w[0:3].copy_(QuantizedRows(fmt, torch.from_numpy(ours[:3]), 96))
    w[3:6].copy_(x[3:6])
    assert torch.equal(w.blocks, torch.from_numpy(ours))


def test_k_quants_cannot_be_quantized_here() -> None:
    with pytest.raises(NotImplementedError):
        BlockQuantWeight.empty("q4_k", 2, 256).copy_(torch.zeros(2, 256))


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("fmt", FORMATS)
def test_products_are_the_same_bits_on_every_vector_path(fmt: str) -> None:
    """The k-quants end each super-block of each output as two exact integer terms taken into fp32 by
    the same steps (quant_dot.h's superblock_step), the other formats each 32-value chunk as one exact
    sum (and q4_1 / q5_1 its sum of x times the min) taken into one of eight accumulators
    (exact_chunk_dot), whichever kernel (the pair kernel below 8 rows of x, quant_panel.h's from 8
    on) and whichever vector width: the native AVX512-VNNI build and the AVX2 one give the same bits.
    (The 32-value formats: 11 chunks, a whole step of eight and a tail of three.)"""
    native, avx2 = load_build("native"), load_build("no-vnni")
    rng = np.random.default_rng(23 + FORMATS.index(fmt))
    spec = BLOCK_FORMATS[fmt]
    n, k = 21, (3 if spec.block_size == 256 else 11) * spec.block_size
    raw = random_blocks(fmt, n, k, rng)
    for m in (1, 5, 8, 33):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(torch.bfloat16)
        x[:, : k // 3] *= 20
        outs = []
        for lib in (native, avx2):
            out = torch.empty((m, n), dtype=torch.float32)
            assert lib.nanoserve_quant_linear_bf16_out_f32(x.data_ptr(), raw.ctypes.data, int(spec.qtype), None,
                                                           out.data_ptr(), n, m, n, k, 2) == 1
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), f"{fmt} M={m}: max difference {(outs[0] - outs[1]).abs().max().item()}"


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_s_rows_do_not_depend_on_the_other_rows(fmt: str, dtype: torch.dtype) -> None:
    """Batch invariance for each block format: CpuLayerOps.linear and .logits give a row the same
    bits alone, among 3, 9, 16, 33 or 128 rows or among 140 (one arithmetic for any number of rows;
    quant_panel.h unpacks W band by band while x's rows fit one block of its kernel, at this K up
    to 128 rows with 512-bit vectors and 64 with 256, and once for all of x's blocks past that; on
    a CPU with AMX the superblock formats' 33, 128 and 140 rows take quant_amx.h's tiles, the last
    past one block, q6_k's and q3_k's 9 and 16 rows too, and 67 rows of W end in a partial band of
    its 16), and the fp32 logits rounded to the dtype are linear's output. (The 32-value formats:
    17 blocks, an odd count with a tail past every whole step.)"""
    lib = load_cpu_kernels()
    assert lib is not None
    ops = CpuLayerOps(lib)
    rng = np.random.default_rng(11 + FORMATS.index(fmt))
    k = 512 if BLOCK_FORMATS[fmt].block_size == 256 else 544
    w = BlockQuantWeight(fmt, torch.from_numpy(random_blocks(fmt, 67, k, rng)), k, dtype)
    rows = torch.from_numpy(rng.standard_normal((140, k)).astype(np.float32)).to(dtype)
    whole, logits = ops.linear(rows, w), ops.logits(rows, w)
    assert logits.dtype == torch.float32
    for m in (1, 3, 9, 16, 33, 128):
        assert torch.equal(ops.linear(rows[:m], w), whole[:m]), m
        assert torch.equal(ops.logits(rows[:m], w), logits[:m]), m
    assert torch.equal(torch.cat([ops.linear(rows[i:i + 1], w) for i in range(140)]), whole)
    assert torch.equal(logits.to(dtype), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layer_ops_products_of_quantized_and_stacked_weights(dtype: torch.dtype) -> None:
    """CpuLayerOps.linear on a stacked weight (q4_k, a dense part, q6_k, with a bias) against the
    reference (dequantize, then F.linear): within the activation quantization bound at any number of
    rows (quant.cpp's int8 products), each row the same bits whatever the other rows, the LM head's
    fp32 logits too; and embed gathers the dequantized rows."""
    lib = load_cpu_kernels()
    assert lib is not None
    ops = CpuLayerOps(lib)
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    k = 512
    top = BlockQuantWeight("q4_k", torch.from_numpy(random_blocks("q4_k", 37, k, rng)), k, dtype)
    bottom = BlockQuantWeight("q6_k", torch.from_numpy(random_blocks("q6_k", 1100, k, rng)), k, dtype)
    dense = DenseWeight(torch.randn(9, k, generator=gen).to(dtype))
    w = StackedWeight([top, dense, bottom])
    dense_w = torch.cat([dequantize(top), dense.weight.float(), dequantize(bottom)])
    bias = torch.randn(w.out_features, generator=gen).to(dtype)
    rows = torch.randn(70, k, generator=gen).to(dtype)
    whole, logits = ops.linear(rows, w, bias), ops.logits(rows, bottom)
    assert logits.dtype == torch.float32
    for m in (1, 3, 33, 70):
        x = rows[:m]
        got = ops.linear(x, w, bias)
        assert torch.equal(got, whole[:m]) and torch.equal(ops.logits(x, bottom), logits[:m]), m
        exact = x.float() @ dense_w.T + bias.float()
        tol = (bound(dense_w, x.float(), superblock=True) + exact.abs() * 2**-7
               + (2**-8 if dtype == torch.bfloat16 else 0))
        assert ((got.float() - exact).abs() <= tol).all(), m
    assert torch.equal(torch.cat([ops.logits(rows[i:i + 1], bottom) for i in range(70)]), logits)
    assert torch.equal(logits.to(dtype), ops.linear(rows, bottom))  # the same sums, rounded to the dtype
    ids = torch.tensor([[5, 0], [1099, 17]])
    assert torch.equal(ops.embed(ids, bottom), dequantize(bottom, dtype)[ids])
    with pytest.raises(IndexError):
        ops.embed(torch.tensor([1100]), bottom)
