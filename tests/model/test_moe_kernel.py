"""moe.cpp's routed feed-forward (through `CpuLayerOps.moe_ffn`) against an oracle written here:
each expert's blocks dequantized by gguf-py (an independent implementation of the GGUF formats),
then each token's k experts in plain fp32 torch, on every instruction set path this CPU can run (the
native build and, where the CPU has VNNI, builds without it (AVX2) and without AVX2 (scalar)).

Checked: the outputs within six standard deviations of the error int8 activations add (the kernel
quantizes x and the hidden silu(gate) * up in blocks of 32, for k-quant weights in their super-blocks
of 256, each value off by at most 1/254 of its block's largest; `oracle` carries those rounding errors
through the layer); that a wrong expert moves most outputs beyond that tolerance; each token's row bit
for bit the one-token call's and a five-token call's (batch invariance, across moe.cpp's two ways of
sharing work among threads); and the experts no token chose never read (their fp16 scales are NaN,
so any read would spread NaNs into the output).
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf.quants
import numpy as np
import pytest
import torch

from nanoserve.model.layer_ops import CpuLayerOps
from nanoserve.model.moe import grouped_moe_ffn
from nanoserve.model.quant.block_quant import BLOCK_FORMATS, BlockQuantWeight
from nanoserve.model.quant.weight_formats import DenseWeight
from tests.support.kernel_builds import BUILD_PARAMS, load_build

# Byte offsets of each format's fp16 scales within a block.
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
NAN_FP16 = np.array([np.nan], dtype=np.float16).view(np.uint8)
# (gate, up, down) formats: one format each, and Q4_K_M's expert mix.
FORMATS = [("q8_0",) * 3, ("q4_0",) * 3, ("q4_k",) * 3, ("q6_k",) * 3, ("q4_k", "q4_k", "q6_k")]
HIDDEN, INTER = 256, 512


# The builds for older instruction sets are the ones test_quant_kernels loads (the AVX2 one prebuilt at
# install, the scalar one compiled once into the on-disk cache, which serves both files).
@pytest.fixture(scope="module", params=BUILD_PARAMS)
def ops(request: pytest.FixtureRequest) -> CpuLayerOps:
    return CpuLayerOps(load_build(request.param))


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two threads: moe.cpp then shares whole experts among them when a call chooses four or more
    (most calls here) and (expert, columns) items when fewer (the one-token calls of k = 1 or 2)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def random_experts(fmt: str, experts: int, rows: int, in_features: int, unchosen: list[int],
                   rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks of `experts` stacked experts of `rows` rows each: random bytes, fp16
    scales in +-[0.001, 0.02] (NaN in the experts `unchosen`), q8_0 quants in [-127, 127]."""
    spec = BLOCK_FORMATS[fmt]
    raw = rng.integers(0, 256, size=(experts * rows, spec.row_bytes(in_features)), dtype=np.uint8)
    blocks = raw.reshape(experts, -1, spec.type_size)
    for at in SCALE_OFFSETS[fmt]:
        scales = rng.uniform(0.001, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
        blocks[:, :, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        blocks[unchosen, :, at:at + 2] = NAN_FP16
    if fmt == "q8_0":
        quants = blocks[:, :, 2:].view(np.int8)
        quants[quants == -128] = -127
    return raw


def activation_block(fmt: str) -> int:
    """The values per activation step of a product with W of format fmt: a k-quant's super-block, else 32."""
    return 256 if fmt.endswith("_k") else 32


def rounding_variance(v: torch.Tensor, block: int) -> torch.Tensor:
    """The variance of the error int8 quantization in blocks of `block` values puts on each value of
    v [..., n]: rounding to a step of amax / 127 is off by at most half a step, evenly spread:
    (amax / 254)^2 / 3."""
    amax = v.abs().reshape(*v.shape[:-1], -1, block).amax(dim=-1, keepdim=True)
    return (amax.expand(*amax.shape[:-1], block).reshape(v.shape) / 254) ** 2 / 3


def oracle(x: torch.Tensor, w: list[torch.Tensor], ids: torch.Tensor, weights: torch.Tensor,
           fmts: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) in fp32, token by
    token (w: the dense gate, up [E, I, H] and down [E, H, I]), and the standard deviation of what
    int8 activations add to it, carried through the layer as independent rounding errors: x's
    through gate and up (W^2 times the variances), through silu (slope at most 1.1) and the product,
    plus the hidden's own rounding, through down, weighted; each rounding in the blocks of its
    product's format (fmts: gate's, up's, down's)."""
    gate, up, down = w
    out, var = torch.zeros(x.shape), torch.zeros(x.shape)
    for t in range(x.shape[0]):
        vx = rounding_variance(x[t], activation_block(fmts[0]))
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gate[e] @ x[t], up[e] @ x[t]
            vg, vu = gate[e] ** 2 @ vx, up[e] ** 2 @ vx
            h = torch.nn.functional.silu(g) * u
            vh = (1.21 * vg * u**2 + torch.nn.functional.silu(g) ** 2 * vu
                  + rounding_variance(h, activation_block(fmts[2])))
            out[t] += weights[t, j] * (down[e] @ h)
            var[t] += weights[t, j] ** 2 * (down[e] ** 2 @ vh)
    return out, var.sqrt()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("experts", "k"), [(4, 1), (8, 2)])
@pytest.mark.parametrize("fmts", FORMATS, ids=["-".join(f) for f in FORMATS])
def test_moe_ffn_against_the_oracle(ops: CpuLayerOps, fmts: tuple[str, str, str], experts: int, k: int,
                                    dtype: torch.dtype) -> None:
    check(ops, fmts, experts, k, HIDDEN, INTER, dtype, np.random.default_rng(FORMATS.index(fmts) * 10 + experts + k))


def test_moe_ffn_with_a_partial_last_column_task(ops: CpuLayerOps) -> None:
    """Widths that are not a multiple of moe.cpp's 64 columns per work item (q8_0 rows of 96 and 160
    values): the last item of each product is short."""
    check(ops, ("q8_0",) * 3, 6, 2, 96, 160, torch.float32, np.random.default_rng(99))


def check(ops: CpuLayerOps, fmts: tuple[str, ...], experts: int, k: int, hidden: int, inter: int,
          dtype: torch.dtype, rng: np.random.Generator) -> None:
    """moe_ffn of 33 tokens against the oracle, the tolerance against a wrong routing, and each row
    against one-token and five-token calls (see the module docstring)."""
    chosen = [*range(0, experts, 2), experts - 1]  # the others' scales are NaN
    unchosen = [e for e in range(experts) if e not in chosen]
    shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    raws = [random_experts(f, experts, rows, cols, unchosen, rng) for f, (rows, cols) in zip(fmts, shapes, strict=True)]
    weights_ = [BlockQuantWeight(f, torch.from_numpy(r), cols, dtype)
                for f, r, (_, cols) in zip(fmts, raws, shapes, strict=True)]
    dense = [torch.from_numpy(gguf.quants.dequantize(r, BLOCK_FORMATS[f].qtype).astype(np.float32))
             .reshape(experts, rows, cols) for f, r, (rows, cols) in zip(fmts, raws, shapes, strict=True)]
    tokens = 33
    x = torch.from_numpy(rng.standard_normal((tokens, hidden)).astype(np.float32)).to(dtype)
    x[:, : hidden // 4] *= 10  # blocks of very different magnitudes
    ids = torch.tensor(np.stack([rng.choice(chosen, k, replace=False) for _ in range(tokens)]), dtype=torch.int64)
    topk = torch.from_numpy(rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32))

    out = ops.moe_ffn(x, *weights_, ids, topk)
    assert out.dtype == dtype and out.shape == x.shape and torch.isfinite(out).all()
    assert activation_block(fmts[0]) == activation_block(fmts[1])  # gate and up share x's quantization
    ref, sigma = oracle(x.float(), dense, ids, topk, fmts)
    # Six standard deviations, 1e-5 of the magnitudes for fp32 sums, and for bf16 the output's rounding.
    tol = 6 * sigma + 1e-5 * ref.abs() + (ref.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    err = (out.float() - ref).abs()
    assert (err <= tol).all(), f"max excess {(err - tol).max().item()}"
    # The tolerance discriminates: another expert in every slot moves most of every row's outputs
    # beyond it (with one activation step per 256 values, the k-quants' tolerance is the wider).
    other = {e: chosen[(i + 1) % len(chosen)] for i, e in enumerate(chosen)}
    wrong, _ = oracle(x.float(), dense, ids.clone().apply_(other.__getitem__), topk, fmts)
    assert ((wrong - ref).abs() > tol).float().mean(dim=1).min() > 0.7

    # Batch invariance: each row alone, and five rows together, are the 33-row call's bits.
    for t in (0, 7, 32):
        assert torch.equal(ops.moe_ffn(x[t:t + 1], *weights_, ids[t:t + 1], topk[t:t + 1]), out[t:t + 1]), t
    assert torch.equal(ops.moe_ffn(x[10:15], *weights_, ids[10:15], topk[10:15]), out[10:15])


def test_moe_ffn_refuses_what_it_does_not_take(ops: CpuLayerOps) -> None:
    """A dense expert is not the kernel's: the generic grouped implementation takes it; an expert id
    outside [0, E) and shapes that are not stacked experts are errors, raised before any work."""
    rng = np.random.default_rng(0)
    gate = BlockQuantWeight("q8_0", torch.from_numpy(random_experts("q8_0", 2, 64, 256, [], rng)), 256, torch.float32)
    down = BlockQuantWeight("q8_0", torch.from_numpy(random_experts("q8_0", 2, 256, 64, [], rng)), 64, torch.float32)
    x = torch.randn(3, 256)
    ids, topk = torch.tensor([[0], [1], [0]]), torch.ones(3, 1)
    assert torch.isfinite(ops.moe_ffn(x, gate, gate, down, ids, topk)).all()
    dense = DenseWeight(torch.randn(512, 64))
    grouped = grouped_moe_ffn(ops, x, gate, gate, dense, ids, topk)
    assert torch.equal(ops.moe_ffn(x, gate, gate, dense, ids, topk), grouped)
    with pytest.raises(IndexError, match=r"\[0, 2\)"):
        ops.moe_ffn(x, gate, gate, down, torch.tensor([[0], [2], [0]]), topk)
    with pytest.raises(ValueError, match="stacked"):
        ops.moe_ffn(x, gate, gate, gate, ids, topk)
    with pytest.raises(ValueError, match="topk_ids"):
        ops.moe_ffn(x, gate, gate, down, ids[:2], topk[:2])
    with pytest.raises(ValueError, match="contiguous"):
        ops.moe_ffn(x.T.contiguous().T, gate, gate, down, ids, topk)

