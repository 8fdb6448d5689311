// The quantized products with kPanelMinRows rows of x or more, every format (the superblock_int ones,
// q4_k, q5_k, q6_k, q3_k, q2_k, and exact_chunks, the others): an outer-product micro-kernel in the
// manner of a GEMM's, where superblock_dot and exact_chunk_dot take one (row of W, row of x) pair at
// a time. (On a CPU with AMX-INT8, the superblock_int formats' products take quant_amx.h's tiles
// instead; the same bits.)
//
// Private to the products' translation units (included by quant_dot.h only, after Activations and
// superblock_step, which it uses; see quant.cpp for the files' roles). Everything is in the unnamed
// namespace.
//
// Layout. x's rows in groups of kPanelRows, one int32 lane of a vector each (16 rows with 512-bit
// vectors, 8 with 256; Activations' panel fields, build_panel): vector i holding values 4i .. 4i + 3
// of each row of the group (64 vectors a super-block, 8 a chunk), with each row's unit and
// sums16 (exact_chunks: each chunk's dx and sum of qx) as lanes likewise. W's rows unpacked once
// (PanelW): each value as a byte, its groups' scales and mins as int32, d and dmin (exact_chunks: the
// bytes, each chunk's d and min); band by band, just before use, when all of x fits one block (a
// decode step's rows), else a task's rows at once. dot4 (vpdpbusd; vpmaddubsw + vpmaddwd on plain
// AVX2) of a broadcast four bytes of one row of W against a vector of x sums four products into each
// row's lane: every instruction's products belong to kPanelRows outputs, so the sub-block scales
// are multiplied in once per sub-block for kPanelRows outputs (vpmulld), not per vector as in
// superblock_dot, and a chunk's fp32 step is one instruction for kPanelRows outputs.
//
// Invariant (batch invariance): each output's integer terms are exactly superblock_dot's (the same
// sums of exact products) and its fp32 steps are superblock_step's, lane by lane, in super-block
// order (exact_chunks: exact_chunk_dot's chunk sums and steps, in chunk order); so an output is the
// same bits whichever kernel computes it and whatever else shares the product.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

#if defined(__AVX2__)

namespace {

constexpr int kBand = 8;  // rows of W per pass of the micro-kernel (raw sums and two terms: 3 x 8 accumulators)
// Unpacking band by band, panel_range prefetches the rows this many bands ahead into L2.
constexpr int kPrefetchBands = 2;

// Rows [0, rows) of W (row_bytes apart) unpacked for panel_block, padded with zero rows to a
// multiple of kBand: u [rows, K] the unsigned values, s and m [rows, K / 256, 16] each group of 16
// values' scale and min (IntScales' s16, m16), d and dmin [rows, K / 256]. exact_chunks: u [rows, K]
// (Group's u: signed values on plain AVX2, kSignTrick), d and (q4_1, q5_1) dmin, the block's min m,
// [rows, K / 32].
struct PanelW {
  std::vector<uint8_t> u;
  std::vector<int32_t> s, m;
  std::vector<float> d, dmin;
};

// The sixteen int16 lanes of v at p as int32.
inline void store_int32(int32_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_cvtepi16_epi32(_mm256_castsi256_si128(v)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), _mm256_cvtepi16_epi32(_mm256_extracti128_si256(v, 1)));
}

// v sized for padded rows of n values, rows [rows, padded) zero; the rows before keep whatever they
// held (unpack_panel_w writes them all), so a buffer reused band after band is neither reallocated nor
// cleared.
template <typename T>
void sized(std::vector<T>& v, int64_t rows, int64_t padded, int64_t n) {
  v.resize(padded * n);
  std::fill(v.begin() + rows * n, v.end(), T{});
}

template <int Q>
void unpack_panel_w(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, PanelW& p) {
  const int64_t padded = (rows + kBand - 1) / kBand * kBand;
  if constexpr (exact_chunks(Q)) {
    const int64_t chunks = K / kChunk;
    sized(p.u, rows, padded, K);
    sized(p.d, rows, padded, chunks);
    sized(p.dmin, has_lane_mins(Q) ? rows : 0, has_lane_mins(Q) ? padded : 0, chunks);
    for (int64_t r = 0; r < rows; ++r)
      if constexpr (Q == kIQ4_XS) {  // eight chunks a block, their scales d * ls
        for (int64_t b = 0; b < K / 256; ++b) {
          const Group<Q> g(w + r * row_bytes + b * layout(Q).bytes);
          for (int c = 0; c < 8; ++c)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.u.data() + r * K + b * 256 + c * kChunk), g.u(c));
          _mm256_storeu_ps(p.d.data() + r * chunks + b * 8, g.scale8);
        }
      } else {
        for (int64_t c = 0; c < chunks; ++c) {
          const uint8_t* block = w + r * row_bytes + c * layout(Q).bytes;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.u.data() + r * K + c * kChunk), Group<Q>(block).u(0));
          p.d[r * chunks + c] = fp16(block);
          if constexpr (has_lane_mins(Q)) p.dmin[r * chunks + c] = fp16(block + 2);
        }
      }
  } else {
    const int64_t blocks = K / 256;
    sized(p.u, rows, padded, K);
    sized(p.s, rows, padded, blocks * 16);
    sized(p.m, rows, padded, blocks * 16);
    sized(p.d, rows, padded, blocks);
    sized(p.dmin, rows, padded, blocks);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + r * row_bytes + b * layout(Q).bytes;
        const Group<Q> grp(block);
        for (int c = 0; c < 8; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p.u.data() + r * K + b * 256 + c * kChunk), grp.u(c));
        const IntScales sc = int_scales<Q>(block);
        const int64_t at = r * blocks + b;
        store_int32(p.s.data() + at * 16, sc.s16);
        store_int32(p.m.data() + at * 16, sc.m16);
        p.d[at] = sc.d;
        p.dmin[at] = sc.dmin;
      }
  }
}

// acc[t] (lane l: row kPanelRows grp + l of x) = the outputs of rows t0 + t of W (t < kBand) over all of K,
// from zero, superblock_step by superblock_step.
template <int Q>
void panel_block(const PanelW& w, int64_t t0, const Activations& a, int64_t grp, int64_t K, FV acc[kBand]) {
  constexpr int sub = Q == kQ4_K || Q == kQ5_K ? 32 : 16;  // values per scale (and per min)
  constexpr int subs = 256 / sub;
  constexpr bool mins = has_mins(Q);
  constexpr int offset = offset_of(Q);
  static_assert(offset == 0 || (offset & (offset - 1)) == 0, "offset * sums as a shift");
  constexpr int shift = offset == 0 ? 0 : __builtin_ctz(offset);
  const int64_t blocks = K / 256;
  for (int t = 0; t < kBand; ++t) acc[t] = fzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = grp * blocks + b;
    const int8_t* xq = a.pq.data() + at * 64 * kVecValues;
    const int32_t* sums32 = a.psums.data() + at * 16 * kPanelRows;
    IV term1[kBand], term2[kBand];
    for (int t = 0; t < kBand; ++t) term1[t] = term2[t] = izero();
    for (int s = 0; s < subs; ++s) {
      const int i = s * sub / 16;  // the sub-block's first group of 16 values
      IV raw[kBand];
      for (int t = 0; t < kBand; ++t) raw[t] = izero();
#pragma GCC unroll 8
      for (int q = 0; q < sub / 4; ++q) {
        const int kg = s * sub / 4 + q;
        const IV xv = load_i(xq + kg * kVecValues);
        for (int t = 0; t < kBand; ++t) {
          int32_t u4;
          std::memcpy(&u4, w.u.data() + (t0 + t) * K + b * 256 + kg * 4, sizeof u4);
          raw[t] = dot4(raw[t], iset1(u4), xv);
        }
      }
      IV off = izero();
      if constexpr (offset != 0) off = slli32(load_i(sums32 + i * kPanelRows), shift);
      for (int t = 0; t < kBand; ++t) {
        const IV scale = iset1(w.s[((t0 + t) * blocks + b) * 16 + i]);
        const IV part = mullo32(offset != 0 ? sub32(raw[t], off) : raw[t], scale);
        if (!mins && kTerm2Group(i))
          term2[t] = add32(term2[t], part);
        else
          term1[t] = add32(term1[t], part);
      }
    }
    if constexpr (mins)
      for (int s = 0; s < subs; ++s) {
        const int i = s * sub / 16;
        IV sums = load_i(sums32 + i * kPanelRows);
        if constexpr (sub == 32) sums = add32(sums, load_i(sums32 + (i + 1) * kPanelRows));
        for (int t = 0; t < kBand; ++t)
          term2[t] = add32(term2[t], mullo32(sums, iset1(w.m[((t0 + t) * blocks + b) * 16 + i])));
      }
    const FV unit = load_f(a.punit.data() + at * kPanelRows);
    for (int t = 0; t < kBand; ++t) {
      const int64_t wb = (t0 + t) * blocks + b;
      const FV d_unit = mul(fset1(w.d[wb]), unit);
      const FV f2 = mins ? mul(fset1(-w.dmin[wb]), unit) : d_unit;
      acc[t] = fma(to_fp32(term1[t]), d_unit, acc[t]);
      acc[t] = fma(to_fp32(term2[t]), f2, acc[t]);
    }
  }
}

// acc[t] (lane l: row kPanelRows grp + l of x) = the outputs of rows t0 + t of W (t < kBand) over all
// of K, exact_chunks: exact_chunk_dot's steps, its eight accumulators one after the other (the
// chunks c % 8 == r for r = 0 .. 7, each in chunk order), then chunk_total's sum, lane by lane. The
// offset enters as the raw sums' start, -offset * (the chunk's sum of qx).
template <int Q>
void chunk_panel_block(const PanelW& w, int64_t t0, const Activations& a, int64_t grp, int64_t K, FV acc[kBand]) {
  constexpr bool mins = has_lane_mins(Q);
  constexpr int offset = offset_of(Q);
  static_assert(offset == 0 || (offset & (offset - 1)) == 0, "offset * sums as a shift");
  constexpr int shift = offset == 0 ? 0 : __builtin_ctz(offset);
  const int64_t chunks = K / kChunk, Kp = a.Kp;
  const int64_t at0 = grp * (Kp / kChunk);  // the group's first chunk in punit and psums, over kPanelRows
  const int8_t* xq = a.pq.data() + grp * Kp * kPanelRows;
  FV part[8][kBand];
  for (int r = 0; r < 8; ++r) {
    for (int t = 0; t < kBand; ++t) part[r][t] = fzero();
    for (int64_t c = r; c < chunks; c += 8) {
      const IV qsum = load_i(a.psums.data() + (at0 + c) * kPanelRows);
      const IV start = offset != 0 ? sub32(izero(), slli32(qsum, shift)) : izero();
      IV raw[kBand];
      for (int t = 0; t < kBand; ++t) raw[t] = start;
#pragma GCC unroll 8
      for (int q = 0; q < kChunk / 4; ++q) {
        const IV xv = load_i(xq + (c * kChunk / 4 + q) * kVecValues);
        const IV ax = abs8(xv);  // (the sign form only)
        for (int t = 0; t < kBand; ++t) {
          int32_t u4;
          std::memcpy(&u4, w.u.data() + (t0 + t) * K + c * kChunk + q * 4, sizeof u4);
          raw[t] = kSignTrick && signed_values(Q) ? dot4(raw[t], ax, sign_mul(iset1(u4), xv))
                                                  : dot4(raw[t], iset1(u4), xv);
        }
      }
      const FV dx = load_f(a.punit.data() + (at0 + c) * kPanelRows);
      for (int t = 0; t < kBand; ++t) {
        const int64_t wc = (t0 + t) * chunks + c;
        part[r][t] = fma(to_fp32(raw[t]), mul(fset1(w.d[wc]), dx), part[r][t]);
        if constexpr (mins) part[r][t] = fma(to_fp32(qsum), mul(fset1(w.dmin[wc]), dx), part[r][t]);
      }
    }
  }
  for (int t = 0; t < kBand; ++t)
    acc[t] = add(add(add(part[0][t], part[4][t]), add(part[2][t], part[6][t])),
                 add(add(part[1][t], part[5][t]), add(part[3][t], part[7][t])));
}

// The outputs acc[t] (lane l: row kPanelRows grp + l of x; t < kBand) of W's rows n0 + t that are
// before end, biased, into out's rows of panel group grp (M rows of x in all).
template <typename T, typename O>
void store_band(const FV acc[kBand], const T* bias, O* out, int64_t out_stride, int64_t M, int64_t grp, int64_t n0,
                int64_t end) {
  float v[kBand][kPanelRows];
  for (int t = 0; t < kBand; ++t) store_f(v[t], acc[t]);
  const int64_t rows = std::min<int64_t>(kPanelRows, M - grp * kPanelRows);
  if (n0 + kBand <= end) {  // a whole band: each row's kBand outputs transposed into one vector
    static_assert(kBand == kLanes, "one vec8 a row");
    const vec8 b = bias != nullptr ? load8(bias + n0) : vec8{};
    for (int64_t l = 0; l < rows; ++l) {
      vec8 row;
      for (int t = 0; t < kBand; ++t) row[t] = v[t][l];
      store8(row + b, out + (grp * kPanelRows + l) * out_stride + n0);
    }
  } else {
    for (int t = 0; n0 + t < end; ++t)
      for (int64_t l = 0; l < rows; ++l)
        from_float(v[t][l] + (bias != nullptr ? to_float(bias[n0 + t]) : 0.0f),
                   out + (grp * kPanelRows + l) * out_stride + n0 + t);
  }
}

// Output columns [begin, end) for all M rows of x (a.pq built): x's groups in blocks that stay in L2,
// each block against every band of kBand rows of W, each row of W unpacked once.
template <int Q, typename T, typename O>
void panel_range(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, O* out,
                 int64_t out_stride, int64_t M, int64_t K, int64_t begin, int64_t end) {
  const int64_t groups = (M + kPanelRows - 1) / kPanelRows;
  const int64_t per_block = std::clamp<int64_t>((256 << 10) / (kPanelRows * K), 1, 8);
  // With x's groups all in one block, each band of W's rows is unpacked just before its one use, into
  // a buffer of kBand rows that stays in L1 / L2; with several blocks, the range's rows once, read
  // again by every block.
  const bool by_band = groups <= per_block;
  PanelW pw;
  if (!by_band) unpack_panel_w<Q>(w + begin * row_bytes, row_bytes, end - begin, K, pw);
  for (int64_t g0 = 0; g0 < groups; g0 += per_block)
    for (int64_t t0 = 0; t0 < end - begin; t0 += kBand) {
      if (by_band) {
        const int64_t n = std::min<int64_t>(kBand, end - begin - t0);
        unpack_panel_w<Q>(w + (begin + t0) * row_bytes, row_bytes, n, K, pw);
        // W's rows follow one another in memory: the band kPrefetchBands on, into L2 meanwhile.
        const int64_t ahead = t0 + kPrefetchBands * kBand;
        const uint8_t* next = w + (begin + ahead) * row_bytes;
        const int64_t next_bytes = std::clamp<int64_t>(end - begin - ahead, 0, kBand) * row_bytes;
        for (int64_t at = 0; at < next_bytes; at += 64) __builtin_prefetch(next + at, 0, 2);
      }
      const int64_t pw_row = by_band ? 0 : t0;  // the band's first row in pw
      for (int64_t grp = g0; grp < std::min(groups, g0 + per_block); ++grp) {
        FV acc[kBand];
        if constexpr (exact_chunks(Q))
          chunk_panel_block<Q>(pw, pw_row, a, grp, K, acc);
        else
          panel_block<Q>(pw, pw_row, a, grp, K, acc);
        store_band(acc, bias, out, out_stride, M, grp, begin + t0, end);
      }
    }
}

}  // namespace

#endif
