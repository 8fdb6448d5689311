"""Block-quantized weights: rows of a matrix stored as GGUF stores them (ggml's block formats).

A block format cuts each row of W into blocks of `block_size` values and stores each block in
`type_size` bytes: a few fp16 scales and packed small integers. A row of `in_features` values is
`row_bytes(in_features)` bytes, its blocks side by side; a matrix is its rows one after another,
exactly the bytes of a GGUF tensor. The formats here, byte for byte as ggml lays them out:

- q8_0 (32 values, 34 bytes): fp16 d, int8 q[32]; value = d * q.
- q4_0 (32 values, 18 bytes): fp16 d, 16 bytes of nibbles: byte j holds value j (low nibble) and
  value j + 16 (high nibble); value = d * (nibble - 8).
- q4_1 (32 values, 20 bytes): fp16 d, fp16 m, q4_0's nibbles; value = d * nibble + m.
- q5_0 (32 values, 22 bytes): fp16 d, 4 bytes qh (bit i of the little-endian uint32 tops value i
  as its fifth bit), q4_0's nibbles; value = d * (q - 16).
- q5_1 (32 values, 24 bytes): fp16 d, fp16 m, q5_0's qh and nibbles; value = d * q + m.
- iq4_nl (32 values, 18 bytes): fp16 d, q4_0's nibbles, each indexing the 16 non-linear values
  IQ4_VALUES; value = d * IQ4_VALUES[nibble].
- q4_k (256 values, 144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and eight 6-bit
  mins (one per 32 values), 128 bytes of nibbles: the 32 bytes of chunk c hold values 64c + l (low
  nibble) and 64c + 32 + l (high); value = d * scale * nibble - dmin * min.
- q5_k (256 values, 176 bytes): q4_k's fields, then 32 bytes qh of fifth bits, then the nibbles;
  bit 2c of qh[l] tops value 64c + l, bit 2c + 1 value 64c + 32 + l.
- q6_k (256 values, 210 bytes): 128 bytes ql of low nibbles, 64 bytes qh of high bit pairs, sixteen
  int8 scales (one per 16 values), fp16 d; value = d * scale * (q - 32).
- iq4_xs (256 values, 136 bytes): fp16 d, uint16 of the eight scales' top two bits (bits 2c, 2c + 1
  for sub-block c), 4 bytes of their low nibbles (sub-block 2i the low nibble of byte i, 2i + 1 the
  high), then per sub-block of 32 values 16 bytes of nibbles laid out as iq4_nl's; value =
  d * (scale - 32) * IQ4_VALUES[nibble].
- q3_k (256 values, 110 bytes): 32 bytes hmask, 64 bytes qs of 2-bit values, 12 bytes of sixteen
  6-bit scales (one per 16 values: scale i has the low or high nibble of byte i % 8, for i < 8 or
  not, and bits 2 (i / 4), 2 (i / 4) + 1 of byte 8 + i % 4 on top), fp16 d. Value 128h + 32s + l is
  bits 2s, 2s + 1 of qs[32h + l] plus 4 if bit 4h + s of hmask[l] is set; value = d * (scale - 32) *
  (q - 4).
- q2_k (256 values, 84 bytes): sixteen bytes of a 4-bit scale (low nibble) and a 4-bit min (high
  nibble), one per 16 values, 64 bytes qs of 2-bit values laid out as q3_k's, fp16 d, fp16 dmin;
  value = d * scale * q - dmin * min.

`QuantizedRows` carries raw blocks of some rows (what the GGUF reader hands over), `BlockQuantWeight`
is a `LinearWeight` stored in one of these formats, `StackedWeight` a fused matrix whose row ranges
are stored in different formats. `dequantize` here is the plain torch reference (any device); the
CPU products are nanoserve/csrc/quant.cpp's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from gguf import GGMLQuantizationType
from torch import nn

from nanoserve.model.quant.weight_formats import LinearWeight, WeightDestination


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One GGUF block layout: `block_size` values in `type_size` bytes."""

    name: str
    qtype: GGMLQuantizationType
    block_size: int
    type_size: int

    def row_bytes(self, in_features: int) -> int:
        """The bytes of a row of `in_features` values; ValueError unless whole blocks fill it."""
        if in_features % self.block_size:
            raise ValueError(f"{self.name} rows hold a multiple of {self.block_size} values, not {in_features}")
        return in_features // self.block_size * self.type_size


BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("q8_0", GGMLQuantizationType.Q8_0, 32, 34),
    BlockFormat("q4_0", GGMLQuantizationType.Q4_0, 32, 18),
    BlockFormat("q4_1", GGMLQuantizationType.Q4_1, 32, 20),
    BlockFormat("q5_0", GGMLQuantizationType.Q5_0, 32, 22),
    BlockFormat("q5_1", GGMLQuantizationType.Q5_1, 32, 24),
    BlockFormat("iq4_nl", GGMLQuantizationType.IQ4_NL, 32, 18),
    BlockFormat("q4_k", GGMLQuantizationType.Q4_K, 256, 144),
    BlockFormat("q5_k", GGMLQuantizationType.Q5_K, 256, 176),
    BlockFormat("q6_k", GGMLQuantizationType.Q6_K, 256, 210),
    BlockFormat("iq4_xs", GGMLQuantizationType.IQ4_XS, 256, 136),
    BlockFormat("q3_k", GGMLQuantizationType.Q3_K, 256, 110),
    BlockFormat("q2_k", GGMLQuantizationType.Q2_K, 256, 84),
)}
# iq4_nl's and iq4_xs's values, indexed by a nibble (ggml's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def block_format(fmt: str) -> BlockFormat:
    """The format named `fmt`; ValueError naming the known ones otherwise."""
    try:
        return BLOCK_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown block format {fmt!r}; known: {', '.join(BLOCK_FORMATS)}") from None


class QuantizedRows:
    """Raw GGUF blocks of `rows` rows of a matrix: `data` uint8 [rows, row_bytes] (contiguous when
    made here; a view of its rows otherwise), each row `in_features` values in format `fmt`."""

    def __init__(self, fmt: str, data: torch.Tensor, in_features: int) -> None:
        row_bytes = block_format(fmt).row_bytes(in_features)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes:
            raise ValueError(f"{fmt} rows of {in_features} values are uint8 [rows, {row_bytes}], "
                             f"not {data.dtype} {list(data.shape)}")
        self.fmt = fmt
        self.data = data
        self.in_features = in_features

    @property
    def shape(self) -> torch.Size:
        """The logical shape [rows, in_features]."""
        return torch.Size((self.data.shape[0], self.in_features))

    def __getitem__(self, rows: slice | torch.Tensor) -> QuantizedRows:
        """The rows `rows` (a slice, or a LongTensor of row indices): a view for a slice, a copy
        for indices."""
        return QuantizedRows(self.fmt, self.data[rows], self.in_features)


class BlockQuantWeight(LinearWeight):
    """W stored in a GGUF block format (`format`, a key of BLOCK_FORMATS): the uint8 buffer
    `blocks` [out_features, row_bytes], each row the bytes of one output feature's row as GGUF
    lays it out. `dtype` is the model's dtype, fixed at construction (`.to()` moves the blocks and
    leaves it): what `dequantize` of its rows and the embedding gather give by default (products
    come out in the dtype of x)."""

    def __init__(self, fmt: str, blocks: torch.Tensor, in_features: int, dtype: torch.dtype) -> None:
        """Wraps `blocks` (shared, not copied); ValueError unless it is uint8 [out, row_bytes]."""
        rows = QuantizedRows(fmt, blocks, in_features)
        super().__init__(blocks.shape[0], in_features)
        self.format = fmt
        self.dtype = dtype
        # Registered directly (nn.Module.__setattr__ would refuse the name of the property below).
        self._buffers["blocks"] = rows.data

    @property
    def blocks(self) -> torch.Tensor:
        """The registered buffer "blocks" (whatever `.to()` put there), read without
        nn.Module.__getattr__'s fallback."""
        return cast(torch.Tensor, self._buffers["blocks"])

    @classmethod
    def empty(cls, fmt: str, out_features: int, in_features: int,
              dtype: torch.dtype = torch.float32) -> BlockQuantWeight:
        """An uninitialised weight, for the loader to fill."""
        row_bytes = block_format(fmt).row_bytes(in_features)
        return cls(fmt, torch.empty(out_features, row_bytes, dtype=torch.uint8), in_features, dtype)

    @property
    def rows(self) -> QuantizedRows:
        """All of W's rows, sharing `blocks`."""
        return QuantizedRows(self.format, self.blocks, self.in_features)

    def __getitem__(self, rows: slice) -> BlockRows:
        return BlockRows(self, rows)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dtype={self.dtype}"


class BlockRows:
    """The rows `rows` of a BlockQuantWeight as a loader destination. `copy_` takes QuantizedRows of
    the weight's format (a byte copy) or dense values, quantized here as ggml's reference
    quantizers do (q8_0 and q4_0; NotImplementedError for the other formats)."""

    def __init__(self, weight: BlockQuantWeight, rows: slice) -> None:
        if rows.step not in (None, 1):
            raise ValueError("a weight's rows are written as a slice with step 1")
        self.weight = weight
        self.target: torch.Tensor = weight.blocks[rows]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.target.shape[0], self.weight.in_features))

    def copy_(self, src: torch.Tensor | QuantizedRows) -> BlockRows:
        if src.shape != self.shape:
            raise ValueError(f"rows of shape {list(self.shape)} cannot take {list(src.shape)}")
        if isinstance(src, QuantizedRows):
            if src.fmt != self.weight.format:
                raise ValueError(f"{self.weight.format} rows cannot take {src.fmt} blocks")
            self.target.copy_(src.data)
        else:
            self.target.copy_(quantize(src, self.weight.format))
        return self


class StackedWeight(LinearWeight):
    """A fused W (q/k/v, gate/up) whose consecutive row ranges, `parts`, are LinearWeights of their
    own (as a GGUF file stores them, possibly in different formats). Invariants: every part has
    `in_features` columns; W's rows are the parts' rows in order; a row slice lies within one part."""

    format = "stacked"

    def __init__(self, parts: list[LinearWeight]) -> None:
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a stacked weight takes one or more parts with the same in_features")
        super().__init__(sum(p.out_features for p in parts), parts[0].in_features)
        self.stack = nn.ModuleList(parts)

    @property
    def parts(self) -> list[LinearWeight]:
        """The parts, top rows first."""
        return cast(list[LinearWeight], list(self.stack))

    def __getitem__(self, rows: slice) -> WeightDestination:
        lo, hi, step = rows.indices(self.out_features)
        offset = 0
        for part in self.parts:
            if offset <= lo and hi <= offset + part.out_features and step == 1:
                return part[lo - offset:hi - offset]
            offset += part.out_features
        raise ValueError(f"rows {lo}:{hi} of a stacked weight do not lie within one of its parts")

    def copy_(self, src: torch.Tensor) -> StackedWeight:
        offset = 0
        for part in self.parts:
            part.copy_(src[offset:offset + part.out_features])
            offset += part.out_features
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts=[{', '.join(p.format for p in self.parts)}]"


def dequantize(w: BlockQuantWeight | QuantizedRows, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense values [rows, in_features] of `w` in `dtype` (default: a weight's own dtype, fp32
    for QuantizedRows), on the device of its blocks: the decoding spelled out in the module
    docstring, computed in fp32."""
    rows = w.rows if isinstance(w, BlockQuantWeight) else w
    if dtype is None:
        dtype = w.dtype if isinstance(w, BlockQuantWeight) else torch.float32
    fmt = block_format(rows.fmt)
    n = rows.data.shape[0]
    blocks = rows.data.reshape(-1, fmt.type_size)
    values = _DECODERS[rows.fmt](blocks)
    return values.reshape(n, rows.in_features).to(dtype)


def quantize(src: torch.Tensor, fmt: str) -> torch.Tensor:
    """The blocks (uint8 [rows, row_bytes]) of dense [rows, in_features] `src` in `fmt`, as ggml's
    reference quantizers compute them (q8_0: d = max|x| / 127, q = round(x / d), halves away from
    zero; q4_0: d = -m / 8 for m the value of largest magnitude, q = min(15, trunc(x / d + 8.5))).
    NotImplementedError for the k-quants, whose quantizers search scales."""
    spec = block_format(fmt)
    x = src.detach().to(torch.float32).reshape(-1, spec.block_size)
    if fmt == "q8_0":
        d = x.abs().amax(dim=1, keepdim=True) / 127
        q = _round_half_away(x * _reciprocal(d)).to(torch.int8).view(torch.uint8)
    elif fmt == "q4_0":
        picked = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
        d = picked / -8
        q4 = torch.trunc(x * _reciprocal(d) + 8.5).clamp(0, 15).to(torch.uint8)
        q = q4[:, :16] | (q4[:, 16:] << 4)
    else:
        raise NotImplementedError(f"no quantizer for {fmt}; load {fmt} weights from a GGUF file")
    scale = d.to(torch.float16).view(torch.uint8)
    return torch.cat([scale, q], dim=1).reshape(src.shape[0], spec.row_bytes(src.shape[1]))


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d, with 0 where d is 0 (an all-zero block quantizes to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, halves away from zero (torch.round takes halves to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _fp16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte offset `at` of each block, as fp32 [blocks, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed & 0xF).to(torch.int32), (packed >> 4).to(torch.int32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * blocks[:, 2:].view(torch.int8).to(torch.float32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    low, high = _nibbles(blocks[:, 2:])
    return _fp16(blocks, 0) * (torch.cat([low, high], dim=1) - 8).to(torch.float32)


def _q4(packed: torch.Tensor) -> torch.Tensor:
    """The 32 nibbles [blocks, 32] of 16 bytes: the low nibbles are values 0-15, the high 16-31."""
    low, high = _nibbles(packed)
    return torch.cat([low, high], dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Bit i of the little-endian uint32 in 4 bytes qh [blocks, 4], as 16 * bit [blocks, 32]."""
    shifts = torch.arange(8, dtype=torch.int32, device=qh.device)
    bits = (qh.to(torch.int32)[:, :, None] >> shifts) & 1  # [blocks, byte, bit]: value 8 byte + bit
    return bits.reshape(-1, 32) << 4


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _q4(blocks[:, 4:]).to(torch.float32) + _fp16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _q4(blocks[:, 6:]) | _fifth_bits(blocks[:, 2:6])
    return _fp16(blocks, 0) * (q - 16).to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _q4(blocks[:, 8:]) | _fifth_bits(blocks[:, 4:8])
    return _fp16(blocks, 0) * q.to(torch.float32) + _fp16(blocks, 2)


def _iq4(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=nibbles.device)[nibbles.long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _fp16(blocks, 0) * _iq4(_q4(blocks[:, 2:]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    high = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [blocks, 1]
    low = torch.stack(_nibbles(blocks[:, 4:8]), dim=2).reshape(-1, 8)  # sub-block 2i, 2i + 1 of byte i
    shifts = 2 * torch.arange(8, dtype=torch.int32, device=blocks.device)
    scales = (low | (((high >> shifts) & 3) << 4)) - 32  # [blocks, 8]
    q = _iq4(_q4(blocks[:, 8:].reshape(-1, 16))).reshape(-1, 8, 32)
    return ((_fp16(blocks, 0) * scales.to(torch.float32))[:, :, None] * q).reshape(-1, 256)


def _two_bits(qs: torch.Tensor) -> torch.Tensor:
    """The 256 2-bit values [blocks, 16, 16] of 64 bytes qs: value 128h + 32s + l is bits 2s, 2s + 1 of
    qs[32h + l]."""
    shifts = 2 * torch.arange(4, dtype=torch.int32, device=qs.device).reshape(1, 1, 4, 1)
    return ((qs.to(torch.int32).reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    packed = blocks[:, 0:16].to(torch.int32)
    dl = _fp16(blocks, 80) * (packed & 0xF).to(torch.float32)
    ml = _fp16(blocks, 82) * (packed >> 4).to(torch.float32)
    return (dl[:, :, None] * _two_bits(blocks[:, 16:80]).to(torch.float32) - ml[:, :, None]).reshape(-1, 256)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    packed = blocks[:, 96:108].to(torch.int32)
    i = torch.arange(16, device=blocks.device)
    scales = ((packed[:, i % 8] >> (4 * (i // 8))) & 0xF) | (((packed[:, 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
    dl = _fp16(blocks, 108) * (scales - 32).to(torch.float32)  # [blocks, 16]
    # bit j of hmask[l] tops value 32j + l
    high = (blocks[:, 0:32].to(torch.int32)[:, None, :] >> torch.arange(8, device=blocks.device)[:, None]) & 1
    q = (_two_bits(blocks[:, 32:96]) | (high.reshape(-1, 16, 16) << 2)) - 4
    return (dl[:, :, None] * q.to(torch.float32)).reshape(-1, 256)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and eight 6-bit mins [blocks, 8] of q4_k / q5_k's 12 scale bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales and mins 4-7 take their low
    4 bits from the nibbles of bytes 8-11 and their top 2 bits from the top bits of bytes 0-3 / 4-7."""
    s = packed.to(torch.int32)
    scales = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mins = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 256 4-bit values [blocks, 256] of 128 bytes: chunk c of 32 bytes gives values 64c..64c+31
    (low nibbles) then 64c+32..64c+63 (high nibbles)."""
    low, high = _nibbles(qs.reshape(-1, 4, 32))
    return torch.stack([low, high], dim=2).reshape(-1, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(blocks[:, 4:16])
    q = _k_nibbles(blocks[:, 16:144]).to(torch.float32).reshape(-1, 8, 32)
    value = (_fp16(blocks, 0) * scales)[:, :, None] * q - (_fp16(blocks, 2) * mins)[:, :, None]
    return value.reshape(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48].to(torch.int32)  # [blocks, 32]
    shifts = torch.arange(8, dtype=torch.int32, device=blocks.device)  # bit 2c + h for sub-block 2c + h
    fifth = ((qh[:, None, :] >> shifts[None, :, None]) & 1) << 4  # [blocks, 8, 32]
    q = (_k_nibbles(blocks[:, 48:176]).reshape(-1, 8, 32) | fifth).to(torch.float32)
    value = (_fp16(blocks, 0) * scales)[:, :, None] * q - (_fp16(blocks, 2) * mins)[:, :, None]
    return value.reshape(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32).to(torch.int32)  # [blocks, half, 32-byte run, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)  # [blocks, half, 1, l]
    # Within a half, value 32 * g + l (g = 0..3) is the low (g < 2) or high nibble of ql run g % 2,
    # topped by bits 2g, 2g + 1 of qh[l].
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [blocks, half, g, l]
    shifts = 2 * torch.arange(4, dtype=torch.int32, device=blocks.device).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)) - 32
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)  # one per 16 values
    value = (_fp16(blocks, 208) * scales)[:, :, None] * q.reshape(-1, 16, 16).to(torch.float32)
    return value.reshape(-1, 256)


_DECODERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "iq4_nl": _iq4_nl,
             "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "iq4_xs": _iq4_xs, "q3_k": _q3_k, "q2_k": _q2_k}
