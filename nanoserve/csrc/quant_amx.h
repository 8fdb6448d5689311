// The superblock_int formats' products of many rows of x on AMX-INT8 tiles (Intel's Advanced Matrix
// Extensions, Sapphire Rapids on): where amx_usable, their products of kPanelMinRows rows of x or
// more come here instead of quant_panel.h's micro-kernel.
//
// Private to the products' translation units (included by quant_dot.h only, after quant_panel.h,
// whose store_band it uses; see quant.cpp for the files' roles). Everything is in the unnamed
// namespace.
//
// The arithmetic. superblock_dot's two terms of a super-block (see superblock_step) are sums over
// its 256 values of products of two integers, one from W and one from x:
//   term1 = sum of w' qx over the values of term1's groups, w' = s (u - offset)
//   term2 = (mins) sum of m qx over all values; (offset formats) as term1 over term2's groups
// with s and m the value's sub-block scale and min. qx is a signed byte (one activation step per
// super-block: quant_dot.h); |w'| <= 2^12 needs two: w' = 64 wh + wl with wh = w' >> 6 (signed) and
// wl = w' & 63, so that
//   sum w' qx = 64 (wh . qx) + wl . qx
// two tile products of bytes (tdpbssd, tdpbusd: each sums exactly in int32, far from overflow
// within a super-block), combined in wrapping int32 arithmetic, which is exact because the term
// itself is within int32 (superblock_step). The mins' term, sum of m qx, is a sum over the
// sub-blocks of m times the sub-block's sum of qx (Activations' pks) instead, by vpdpwssd on int16
// pairs (no third C tile and its products). So each output's terms are superblock_dot's
// exactly, and its fp32 steps superblock_step's in super-block order: the same bits as the other
// kernels (batch invariance), whatever the rows.
//
// Layout. A: 16 rows of W, B: 16 rows of x (Activations' px: already in the tiles' layout, four
// values of a row in each int32 column), C: their 16 x 16 int32 sums, row t of C a vector over x's
// rows as quant_panel.h's accumulators. All eight tiles are 16 rows of 64 bytes: a step is 64
// values of K, kAmxSteps steps a super-block, the chunks in kAmxOrder (the offset formats' term1
// steps 0-1, term2 steps 2-3). W's band of 16 rows is unpacked (AmxW) into wh and wl bytes in the
// same order, tile by tile; per super-block the C tiles are stored, combined into the two terms and
// taken into fp32 with AVX-512. Two groups of x's rows at a time, so that each load of W's A tiles
// serves both: tiles 0-1 A (wh, wl), 2-3 B (the two groups' qx), 4-7 C (each group's high and low
// sums).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

#if defined(NANOSERVE_AMX)

namespace {

constexpr int kAmxBand = 16;  // rows of W per tile: one A tile's rows, one C tile's
static_assert(kAmxBand == kPanelRows && kAmxBand == 2 * kBand, "C's rows as two of store_band's bands");

// The tile configuration (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// Rows [0, rows) of W unpacked for amx_block, in bands of kAmxBand rows (the last padded with zero
// rows): wh and wl [bands, K / 256, kAmxSteps, kAmxBand, 64] (a tile each step: row t is W's row,
// its 64 bytes the step's values in kAmxOrder); the mins in pairs of sub-blocks (amx_min_values
// each), as Activations' pks; d and dmin [padded rows, K / 256].
struct AmxW {
  std::vector<int8_t, LineAligned<int8_t>> wh;
  std::vector<uint8_t, LineAligned<uint8_t>> wl;
  std::vector<int32_t> mins;  // (formats with mins) [padded rows, K / 256, pairs]: two sub-blocks' mins, int16 each
  std::vector<float> d, dmin;
};

template <int Q>
void unpack_amx_w(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, AmxW& p) {
  constexpr int offset = offset_of(Q);
  constexpr bool mins = has_mins(Q);
  const int64_t blocks = K / 256, padded = (rows + kAmxBand - 1) / kAmxBand * kAmxBand;
  constexpr int pairs = 128 / amx_min_values(Q);
  p.wh.resize(padded * K);
  p.wl.resize(padded * K);
  sized(p.mins, mins ? rows : 0, mins ? padded : 0, blocks * pairs);
  sized(p.d, rows, padded, blocks);
  sized(p.dmin, rows, padded, blocks);
  // Where row r's 64 bytes of step s of super-block b begin.
  const auto tile_row = [blocks](int64_t r, int64_t b, int s) {
    return (((r / kAmxBand) * blocks + b) * kAmxSteps + s) * kAmxBand * 64 + (r % kAmxBand) * 64;
  };
  for (int64_t r = rows; r < padded; ++r)  // the last band's zero rows
    for (int64_t b = 0; b < blocks; ++b)
      for (int s = 0; s < kAmxSteps; ++s) {
        std::fill_n(p.wh.data() + tile_row(r, b, s), 64, 0);
        std::fill_n(p.wl.data() + tile_row(r, b, s), 64, 0);
      }
  // A vector is chunks 2v and 2v + 1 (uv): value i in byte i, so value pair j in int16 lane j, whose
  // group of 16 values is 4v + j / 8 (a per-lane index into the scales).
  const __m512i low_byte = _mm512_set1_epi16(0x00ff), high_byte = _mm512_set1_epi16(static_cast<int16_t>(0xff00));
  const __m512i by_8 = _mm512_setr_epi32(0, 0, 0, 0, 0x10001, 0x10001, 0x10001, 0x10001, 0x20002, 0x20002, 0x20002,
                                         0x20002, 0x30003, 0x30003, 0x30003, 0x30003);  // int16 lane j: j / 8
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = w + r * row_bytes + b * layout(Q).bytes;
      const Group<Q> grp(block);
      const IntScales sc = int_scales<Q>(block);
      p.d[r * blocks + b] = sc.d;
      p.dmin[r * blocks + b] = sc.dmin;
      const __m512i s16 = _mm512_castsi256_si512(sc.s16);
      if constexpr (mins) {  // sub-block 2q + j's min: its first group of 16 values' (m16)
        alignas(32) uint16_t m16[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(m16), sc.m16);
        constexpr int step = amx_min_values(Q) / 16;
        for (int q = 0; q < pairs; ++q)
          p.mins[(r * blocks + b) * pairs + q] =
              static_cast<int32_t>(m16[2 * q * step] | static_cast<uint32_t>(m16[(2 * q + 1) * step]) << 16);
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i u = grp.uv(v);
        const __m512i scale = _mm512_permutexvar_epi16(_mm512_add_epi16(by_8, _mm512_set1_epi16(static_cast<int16_t>(4 * v))), s16);
        // w' = (u - offset) s for the even values (low bytes) and the odd ones (high bytes), int16.
        const __m512i even = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_and_si512(u, low_byte), _mm512_set1_epi16(offset)), scale);
        const __m512i odd = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_srli_epi16(u, 8), _mm512_set1_epi16(offset)), scale);
        // Back to bytes in place: wh = w' >> 6 (even's low byte, odd's bits 6-13 moved to the high
        // byte), wl = w' & 63.
        const __m512i wh = _mm512_ternarylogic_epi32(high_byte, _mm512_slli_epi16(odd, 2), _mm512_srai_epi16(even, 6), 0xca);
        const __m512i wl = _mm512_and_si512(
            _mm512_ternarylogic_epi32(high_byte, _mm512_slli_epi16(odd, 8), even, 0xca), _mm512_set1_epi8(63));
        // Chunk 2v to its place, 2v + 1 to its (kAmxOrder), each its step and half of it.
        const int64_t at0 = tile_row(r, b, kAmxOrder(2 * v) / 2) + (kAmxOrder(2 * v) % 2) * kChunk;
        const int64_t at1 = tile_row(r, b, kAmxOrder(2 * v + 1) / 2) + (kAmxOrder(2 * v + 1) % 2) * kChunk;
        const auto put = [at0, at1](auto* dst, __m512i bytes) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at0), _mm512_castsi512_si256(bytes));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + at1), _mm512_extracti64x4_epi64(bytes, 1));
        };
        put(p.wh.data(), wh);
        put(p.wl.data(), wl);
      }
    }
}

// acc[g][t] (lane l: row kPanelRows (grp + g) + l of x) = the outputs of row kAmxBand band + t of w
// over all of K, from zero, superblock_step by superblock_step (the tile configuration loaded), for
// G groups of x at once (one or two: each step's A tiles serve both). Per super-block: term1's two
// products (high: wh . qx, low: wl . qx) over its steps (all four; the offset formats' first two),
// stored and combined as 64 high + low (wrapping; exact, as the term is within int32); the offset
// formats' term2 likewise over the last two steps; the mins' term2 = the sum over the sub-blocks of
// m times the sub-block's sum of qx, by vpdpwssd on the int16 pairs, exact.
template <int Q, int G>
void amx_block(const AmxW& w, int64_t band, const Activations& a, int64_t grp, int64_t K, FV acc[][kAmxBand]) {
  static_assert(G == 1 || G == 2, "two groups' C tiles and B tiles, with W's two A tiles, fill the eight tiles");
  constexpr bool mins = has_mins(Q);
  constexpr int passes = mins ? 1 : 2, steps = kAmxSteps / passes, pairs = 128 / amx_min_values(Q);
  constexpr int64_t tile = kAmxBand * 64;  // bytes
  const int64_t blocks = K / 256;
  // A super-block's C tiles: per pass (term1's, then the offset formats' term2's) and group, the high
  // and the low sums.
  alignas(64) int32_t c[passes][G][2][kAmxBand][16];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < kAmxBand; ++t) acc[g][t] = fzero();
  // The tile loads' asm names no memory it reads: a compiler barrier keeps them after the stores
  // that filled w and a (inlined unpacking included).
  __asm__ volatile("" ::: "memory");
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t wt = (band * blocks + b) * kAmxSteps * tile;
    const int8_t* wh = w.wh.data() + wt;
    const uint8_t* wl = w.wl.data() + wt;
    const int8_t* x0 = a.px.data() + (grp * blocks + b) * kAmxSteps * tile;
    const int8_t* x1 = x0 + blocks * kAmxSteps * tile;  // (G == 2) the next group's
    for (int pass = 0; pass < passes; ++pass) {
      _tile_zero(4);
      _tile_zero(5);
      if constexpr (G == 2) {
        _tile_zero(6);
        _tile_zero(7);
      }
      for (int s = pass * steps; s < (pass + 1) * steps; ++s) {
        _tile_loadd(0, wh + s * tile, 64);
        _tile_loadd(1, wl + s * tile, 64);
        _tile_loadd(2, x0 + s * tile, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_dpbusd(5, 1, 2);
        if constexpr (G == 2) {
          _tile_loadd(3, x1 + s * tile, 64);
          _tile_dpbssd(6, 0, 3);
          _tile_dpbusd(7, 1, 3);
        }
      }
      _tile_stored(4, c[pass][0][0], 64);
      _tile_stored(5, c[pass][0][1], 64);
      if constexpr (G == 2) {
        _tile_stored(6, c[pass][G - 1][0], 64);
        _tile_stored(7, c[pass][G - 1][1], 64);
      }
    }
    for (int g = 0; g < G; ++g) {
      const int64_t xb = (grp + g) * blocks + b;
      const FV unit = load_f(a.punit.data() + xb * kPanelRows);
      IV ks[pairs];  // (mins) each pair of sub-blocks' sums of qx, over x's rows
      if constexpr (mins)
        for (int q = 0; q < pairs; ++q) ks[q] = load_i(a.pks.data() + (xb * pairs + q) * kPanelRows);
      for (int t = 0; t < kAmxBand; ++t) {
        const int64_t wb = (band * kAmxBand + t) * blocks + b;
        const IV term1 = add32(slli32(load_i(c[0][g][0][t]), 6), load_i(c[0][g][1][t]));
        IV term2;
        if constexpr (mins) {
          term2 = izero();
          for (int q = 0; q < pairs; ++q) term2 = dot2(term2, iset1(w.mins[wb * pairs + q]), ks[q]);
        } else {
          term2 = add32(slli32(load_i(c[passes - 1][g][0][t]), 6), load_i(c[passes - 1][g][1][t]));
        }
        const FV d_unit = mul(fset1(w.d[wb]), unit);
        const FV f2 = mins ? mul(fset1(-w.dmin[wb]), unit) : d_unit;
        acc[g][t] = fma(to_fp32(term1), d_unit, acc[g][t]);
        acc[g][t] = fma(to_fp32(term2), f2, acc[g][t]);
      }
    }
  }
}

// The outputs acc[t] (lane l: row kPanelRows grp + l of x) of W's rows n0 + t, t < kAmxBand, all
// before end, biased, into out's rows of panel group grp (M rows of x in all): store_band's values
// and rounding, the 16 x 16 block transposed in registers so that each row of x takes its 16
// outputs in two vectors.
template <typename T, typename O>
void store_whole_band(const FV acc[kAmxBand], const T* bias, O* out, int64_t out_stride, int64_t M, int64_t grp,
                      int64_t n0) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows: per 128-bit lane k, columns 4k, 4k + 1 (lo), 4k + 2, 4k + 3 (hi)
    t[2 * i] = _mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + j], 128-bit lane k: rows 4i .. 4i + 3 of column 4k + j
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  __m512 column[16];  // column c: rows 0 .. 15 of column c
  for (int j = 0; j < 4; ++j) {
    const __m512 even = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), odd = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
    const __m512 even2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
    const __m512 odd2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    column[j] = _mm512_shuffle_f32x4(even, even2, 0x88);
    column[8 + j] = _mm512_shuffle_f32x4(even, even2, 0xdd);
    column[4 + j] = _mm512_shuffle_f32x4(odd, odd2, 0x88);
    column[12 + j] = _mm512_shuffle_f32x4(odd, odd2, 0xdd);
  }
  const vec8 b0 = bias != nullptr ? load8(bias + n0) : vec8{}, b1 = bias != nullptr ? load8(bias + n0 + kBand) : vec8{};
  const int64_t rows = std::min<int64_t>(kPanelRows, M - grp * kPanelRows);
  for (int64_t l = 0; l < rows; ++l) {
    O* dst = out + (grp * kPanelRows + l) * out_stride + n0;
    store8(static_cast<vec8>(_mm512_castps512_ps256(column[l])) + b0, dst);
    store8(static_cast<vec8>(_mm512_extractf32x8_ps(column[l], 1)) + b1, dst + kBand);
  }
}

// panel_range on AMX tiles (a's AMX fields built): output columns [begin, end) for all M rows of x,
// x's groups in blocks whose px stays in L2, each block against every band of kAmxBand rows of W
// (its groups two at a time), each row of W unpacked once (with one block, band by band just
// before its use).
template <int Q, typename T, typename O>
void amx_range(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, O* out,
               int64_t out_stride, int64_t M, int64_t K, int64_t begin, int64_t end) {
  const int64_t groups = (M + kPanelRows - 1) / kPanelRows;
  const int64_t per_block = 2 * std::clamp<int64_t>((128 << 10) / (kPanelRows * K), 1, 4);  // pairs of groups
  const bool by_band = groups <= per_block;
  const TileConfig config;
  _tile_loadconfig(&config);
  AmxW pw;
  if (!by_band) unpack_amx_w<Q>(w + begin * row_bytes, row_bytes, end - begin, K, pw);
  for (int64_t g0 = 0; g0 < groups; g0 += per_block)
    for (int64_t t0 = 0; t0 < end - begin; t0 += kAmxBand) {
      if (by_band) {
        unpack_amx_w<Q>(w + (begin + t0) * row_bytes, row_bytes, std::min<int64_t>(kAmxBand, end - begin - t0), K, pw);
        const int64_t ahead = t0 + kAmxBand;  // the next band, into L2 meanwhile
        const uint8_t* next = w + (begin + ahead) * row_bytes;
        const int64_t next_bytes = std::clamp<int64_t>(end - begin - ahead, 0, kAmxBand) * row_bytes;
        for (int64_t at = 0; at < next_bytes; at += 64) __builtin_prefetch(next + at, 0, 2);
      }
      const int64_t band = by_band ? 0 : t0 / kAmxBand;  // in pw
      const int64_t g_end = std::min(groups, g0 + per_block);
      const auto store = [&](const FV acc[kAmxBand], int64_t grp) {
        if (begin + t0 + kAmxBand <= end) {
          store_whole_band(acc, bias, out, out_stride, M, grp, begin + t0);
        } else {
          store_band(acc, bias, out, out_stride, M, grp, begin + t0, end);
          if (begin + t0 + kBand < end) store_band(acc + kBand, bias, out, out_stride, M, grp, begin + t0 + kBand, end);
        }
      };
      int64_t grp = g0;
      for (; grp + 2 <= g_end; grp += 2) {
        FV acc[2][kAmxBand];
        amx_block<Q, 2>(pw, band, a, grp, K, acc);
        store(acc[0], grp);
        store(acc[1], grp + 1);
      }
      if (grp < g_end) {
        FV acc[1][kAmxBand];
        amx_block<Q, 1>(pw, band, a, grp, K, acc);
        store(acc[0], grp);
      }
    }
  _tile_release();
}

}  // namespace

#endif
