// The int8 dot products of the quantized products: x's rows quantized per product (Activations),
// then W's groups (quant_blocks.h) against them with vpdpbusd / vpmaddubsw, for a range of output
// columns (column_range; quant.cpp shares the ranges among threads). AVX2 and up only.
//
// Private to the products' translation units (included by quant.cpp, moe.cpp and the other quant_*.h
// only; see quant.cpp for the files' roles). Everything is in the unnamed namespace: internal linkage
// in each translation unit, so the compiler inlines and specialises as within a single file.
//
// Activations are quantized per product, row by row, in blocks of 32: dx = max|x| / 127, qx =
// round(x / dx) in [-127, 127]. A 32-value stretch ("chunk") of a row of W then contributes
//   sum_i w_i x_i ~= dx * (scale * (sum_i u_i qx_i - offset * sum_i qx_i) + m * sum_i qx_i)
// where the integer sums are exact. Per activation row we keep qx (int8) and each chunk's dx and
// sum of qx (the offset's term, offset * sum of qx, a shift: every offset is a power of two).
//
// Every format but the k-quants below (exact_chunks: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs)
// sums each chunk's products exactly in int32 and takes the sum into fp32 once (q4_1, q5_1: the
// chunk's sum of qx times the block's min m, a second step), into one of eight accumulators per
// output (exact_chunk_dot: the lanes of eight chunks summed by chunk_sums8; from kPanelMinRows rows
// of x on, quant_panel.h's micro-kernel takes the same steps for kPanelRows rows of x at once).
//
// The k-quants with small integer sub-block scales (superblock_int: q4_k, q5_k, q6_k, q3_k, q2_k)
// take llama.cpp's form instead (its q8_K): x quantized again with one step per super-block, unit
// = max|x| of the 256 values / 127, with each 16 values' sum of qx (sums16), so that a super-block
// of W against x sums in int32 (W's sub-block scales multiplied in as integers) into two exact
// terms, which go through fp32 once each (superblock_step). One step for all 256 values keeps qx one
// byte, which AMX's tiles need (quant_amx.h: a per-chunk step would take x's values past a byte
// and double the tile products); a chunk of small values takes the step of the block's largest
// (the cost in a real model's logprobs: docs/benchmarks.md, "One activation step per super-block").
// Below kPanelRows rows of x, superblock_dot sums a (row of W, row of x) pair's terms in lanes
// (vpmaddubsw, then vpdpwssd / vpmaddwd against the spread scales) and folds them; from kPanelRows
// rows on, quant_panel.h's micro-kernel computes the same terms for kPanelRows rows of x at once.
//
// The dot products: with AVX512-VNNI, vpdpbusd multiplies 64 unsigned bytes of W by 64 signed
// bytes of x and adds each group of four into 16 int32 lanes (two chunks per instruction); with
// AVX-VNNI its 256-bit form (one chunk); on plain AVX2, vpmaddubsw (u8 x s8 -> pairs summed to
// int16) then vpmaddwd by ones (-> int32). vpmaddubsw saturates at 2^15 - 1, which u <= 63 never
// reaches but q8_0's u = q + 128 would (and iq4's table + 128), so q8_0, iq4_nl and iq4_xs on plain
// AVX2 take the form llama.cpp uses: |qx| against q * sign(qx), no offset (this needs values in
// [-127, 127], as ggml's quantizers write q8_0 and as kIq4Values are; -128 would flip wrongly).
//
// Structure: in a range of columns, W's rows in groups of NW (one for one row of x, else two)
// against the rows of x in groups of up to kRowsX; each group of W's blocks is unpacked into
// registers once per group of x rows and read from L1 for the next. The superblock_int formats take
// each group of W's rows against all rows of x in turn, so W streams from memory once per call
// (from kPanelRows rows of x on: quant_panel.h); exact_chunks each group of x's rows against all
// the range's rows of W in turn, so x's group stays in L1 and W streams from memory once, then from
// L2 (with two rows of W, the next two prefetched meanwhile; one row is a sequential stream the
// hardware prefetcher follows, helped on Intel cores by column_range's prefetches); from
// kPanelMinRows rows of x on, quant_panel.h (the superblock_int formats, where amx_usable,
// quant_amx.h).
//
// Invariants: the Activations are zero-padded to Kp (a multiple of the vector and of the group), so
// a step past K multiplies zeros; each output is biased and rounded to the output type once, at the
// end. Each output's operations depend on its row of x and its row of W only, not on NW, MX, M or
// the row's place (for the superblock_int formats, the same exact integer terms and superblock_step,
// and for exact_chunks the same exact chunk sums and chunk steps, whichever kernel): batch
// invariance. Since the integer sums are exact and the fp32 steps fixed, an output is also the same
// bits on every vector path (AVX512-VNNI, AVX-VNNI, AVX2).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_blocks.h"

#if defined(__AVX2__)

namespace {

constexpr int kRowsX = 8;  // rows of x per pass over a group of W's rows, at most
// An allocator of cache-line aligned storage (the AMX tiles' rows, 64 bytes, each in one line) whose
// vectors' resize leaves new elements uninitialised: AmxW's bands of W are written whole before
// they are read, so a product need not zero them first (assign and other explicit values
// initialise as usual).
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename V>
  void construct(U* p, V&& value) {
    ::new (static_cast<void*>(p)) U(std::forward<V>(value));
  }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};

// The activation rows of one product, quantized for format Q (see the header comment), K padded
// with zeros to Kp, a multiple of the vector and of the group.
struct Activations {
  int qtype;  // the format of the W these rows were quantized for
  int64_t Kp;
  std::vector<int8_t> q;      // [M, Kp]
  std::vector<float> chunk_scale;  // [M, Kp / 32]: each chunk's dx
  std::vector<int32_t> chunk_sums;  // [M, Kp / 32]: each chunk's sum of qx
  // The same rows quantized for the superblock_int formats, one step (unit) per super-block;
  // filled for those formats only (then Kp == K, a multiple of 256), as the fields above for the
  // others only.
  std::vector<int8_t> q256;     // [M, Kp]
  std::vector<float> unit;      // [M, Kp / 256]: the super-block's max|x| / 127
  std::vector<int16_t> sums16;  // [M, Kp / 16]: each 16 values' sum of qx
  // The rows again in groups of kPanelRows for quant_panel.h (build_panel; empty unless built), the
  // last group padded with zero rows: pq [groups, Kp / 4, kPanelRows, 4] (vector i: values 4i .. 4i
  // + 3 of each row; q256's for the superblock_int formats, q's for exact_chunks). The superblock_int
  // formats: punit [groups, Kp / 256, kPanelRows], psums [groups, Kp / 256, 16 groups of 16 values,
  // kPanelRows] (sums16 as int32). exact_chunks: punit [groups, Kp / 32, kPanelRows] each chunk's dx,
  // psums likewise its sum of qx (chunk_sums).
  std::vector<int8_t> pq;
  std::vector<float> punit;
  std::vector<int32_t> psums;
  // Instead of pq and psums where the products take AMX tiles (the superblock_int formats,
  // amx_usable; see quant_amx.h): px [groups, Kp / 256, kAmxSteps, 16, kPanelRows, 4] q256's bytes,
  // per super-block the B tiles of its kAmxSteps steps of 64 values, row i of a tile holding values
  // 4i .. 4i + 3 of each row of the group, the 32-value chunks in kAmxOrder.
  std::vector<int8_t, LineAligned<int8_t>> px;
  // With it, for the formats with mins: each sub-block's sum of qx (32 values for q4_k and q5_k, 16
  // for q2_k; |sum| <= 32 * 127 < 2^15) in int16 pairs of sub-blocks: [groups, Kp / 256, pairs,
  // kPanelRows] int32, each lane the pair.
  std::vector<int32_t> pks;
};

constexpr int kPanelRows = kVecValues / 4;  // rows of x per panel group: one int32 lane of a vector each
// Rows of x from which the products take quant_panel.h's kernel, the faster from there on (measured,
// for the superblock_int formats and exact_chunks alike).
constexpr int kPanelMinRows = 8;

// The largest |x| of 32 values (four vectors of eight).
inline float amax32(const __m256 v[4]) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  return _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
}

// 32 values as bytes round(v * inv): to nearest even (vcvtps2dq, as lrintf in the default rounding
// mode), then narrowed in order (the packs interleave 128-bit halves; the permute undoes it).
inline __m256i quantize32(const __m256 v[4], float inv) {
  __m256i q32[4];
  for (int i = 0; i < 4; ++i) q32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  const __m256i q16 = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Each 4-value lane's sum of 32 bytes q: bytes times one, pairs summed to int16, then to int32.
inline __m256i lane_sums_of(__m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
}

// Activations for M rows of x and products with W of GGUF type qtype, sized (zero) for quantize_rows:
// for the superblock_int formats their super-block fields (K a multiple of 256, Kp == K), for the
// others the per-chunk fields; the other kind's fields and the panel's empty.
inline void size_activations(Activations& a, int64_t M, int64_t Kp, int qtype) {
  a.qtype = qtype;
  a.Kp = Kp;
  const int64_t chunk_rows = superblock_int(qtype) ? 0 : M, block_rows = M - chunk_rows;
  a.q.assign(chunk_rows * Kp, 0);
  a.chunk_scale.assign(chunk_rows * Kp / kChunk, 0.0f);
  a.chunk_sums.assign(chunk_rows * Kp / kChunk, 0);
  a.q256.assign(block_rows * Kp, 0);
  a.unit.assign(block_rows * Kp / 256, 0.0f);
  a.sums16.assign(block_rows * Kp / 16, 0);
  a.pq.clear();
  a.punit.clear();
  a.psums.clear();
  a.px.clear();
  a.pks.clear();
}

// Rows [m_begin, m_end) of x [.., K] into a (sized by size_activations for the same qtype). The
// superblock_int formats: each super-block its step unit = max|x| / 127 (|qx| <= 127). The others:
// each chunk its own dx = max|x_c| / 127.
template <typename T>
void quantize_rows(const T* x, int64_t m_begin, int64_t m_end, int64_t K, int qtype, Activations& a) {
  if (superblock_int(qtype)) {
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t b = 0; b < K / 256; ++b) {
        const T* src = x + m * K + b * 256;
        float amax = 0.0f;
        for (int c = 0; c < 8; ++c) {
          __m256 v[4];
          for (int i = 0; i < 4; ++i) v[i] = static_cast<__m256>(load8(src + c * kChunk + 8 * i));
          amax = std::max(amax, amax32(v));
        }
        a.unit[m * K / 256 + b] = amax / 127.0f;
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        for (int c = 0; c < 8; ++c) {
          __m256 v[4];
          for (int i = 0; i < 4; ++i) v[i] = static_cast<__m256>(load8(src + c * kChunk + 8 * i));
          const __m256i q = quantize32(v, inv);
          const int64_t at = m * K + b * 256 + c * kChunk;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q256.data() + at), q);
          // Lanes 0-3 hold values 0-15, lanes 4-7 values 16-31: two horizontal adds put their sums in
          // lanes 0 and 4.
          __m256i h = lane_sums_of(q);
          h = _mm256_hadd_epi32(h, h);
          h = _mm256_hadd_epi32(h, h);
          a.sums16[at / 16] = static_cast<int16_t>(_mm256_extract_epi32(h, 0));
          a.sums16[at / 16 + 1] = static_cast<int16_t>(_mm256_extract_epi32(h, 4));
        }
      }
    return;
  }
  const int64_t Kp = a.Kp;
  for (int64_t m = m_begin; m < m_end; ++m)
    for (int64_t c = 0; c < K / kChunk; ++c) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = static_cast<__m256>(load8(x + m * K + c * kChunk + 8 * i));
      const float amax = amax32(v);
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      const __m256i q = quantize32(v, inv);
      const int64_t at = m * Kp + c * kChunk;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + at), q);
      const __m256i lanes = lane_sums_of(q);
      a.chunk_scale[at / kChunk] = d;
      __m256i h = _mm256_hadd_epi32(lanes, lanes);  // twice: lane 0 the sum of lanes 0-3, lane 4 of 4-7
      h = _mm256_hadd_epi32(h, h);
      a.chunk_sums[at / kChunk] = _mm256_extract_epi32(h, 0) + _mm256_extract_epi32(h, 4);
    }
}

#if defined(NANOSERVE_AMX)
constexpr int kAmxSteps = 4;  // AMX tile steps of 64 values a super-block
// The place of chunk c (32 values) of a super-block in the tiles' order: the even chunks first (steps
// 0 and 1), then the odd ones (steps 2 and 3), so that each of the offset formats' two terms
// (kTerm2Group: the odd chunks' groups are term2's) is whole steps.
constexpr int kAmxOrder(int c) { return (c % 2) * 4 + c / 2; }

// Values per min of a format with mins (superblock_int): q2_k's per 16, q4_k's and q5_k's per 32.
constexpr int amx_min_values(int qtype) { return qtype == kQ2_K ? 16 : 32; }

// Row r of x (q256, sums16, unit: quantize_rows') into a's AMX fields (see Activations).
inline void amx_panel_row(Activations& a, int64_t r) {
  const int64_t Kp = a.Kp, blocks = Kp / 256, grp = r / kPanelRows, lane = r % kPanelRows;
  const int sub = amx_min_values(a.qtype), pairs = 128 / sub;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = grp * blocks + b;
    a.punit[at * kPanelRows + lane] = a.unit[r * blocks + b];
    const int16_t* sums16 = a.sums16.data() + r * (Kp / 16) + b * 16;
    if (has_mins(a.qtype))
      for (int p = 0; p < pairs; ++p) {
        uint32_t ks = 0;
        for (int j = 0; j < 2; ++j) {  // sub-block 2p + j: its first group of 16 values, i
          const int i = (2 * p + j) * sub / 16;
          const int sum = sub == 32 ? sums16[i] + sums16[i + 1] : sums16[i];
          ks |= static_cast<uint32_t>(static_cast<uint16_t>(sum)) << (16 * j);
        }
        a.pks[(at * pairs + p) * kPanelRows + lane] = static_cast<int32_t>(ks);
      }
    const int8_t* q = a.q256.data() + r * Kp + b * 256;
    for (int c = 0; c < 8; ++c) {
      // The chunk's eight rows of four values in its place among the super-block's 64 tile rows.
      int8_t* first = a.px.data() + (at * 64 + kAmxOrder(c) * 8) * 4 * kPanelRows + lane * 4;
      for (int i = 0; i < 8; ++i) std::memcpy(first + i * 4 * kPanelRows, q + c * kChunk + 4 * i, 4);
    }
  }
}
#endif

// The panel fields of a (M rows) sized for panel_groups: the AMX ones instead of pq and psums
// where the products take AMX tiles.
inline void size_panel(Activations& a, int64_t M) {
  const int64_t Kp = a.Kp, groups = (M + kPanelRows - 1) / kPanelRows;
  const int64_t blocks = superblock_int(a.qtype) ? Kp / 256 : Kp / kChunk;  // punit's per row
  a.punit.assign(groups * blocks * kPanelRows, 0.0f);
#if defined(NANOSERVE_AMX)
  if (superblock_int(a.qtype) && amx_usable()) {
    a.px.assign(groups * Kp * kPanelRows, 0);
    a.pks.assign(has_mins(a.qtype) ? groups * blocks * 128 / amx_min_values(a.qtype) * kPanelRows : 0, 0);
    a.pq.clear();
    a.psums.clear();
    return;
  }
#endif
  a.pq.assign(groups * Kp * kPanelRows, 0);
  a.psums.assign(groups * blocks * (superblock_int(a.qtype) ? 16 : 1) * kPanelRows, 0);
}

// Panel groups [g_begin, g_end) of a (see Activations) from its row fields (M rows).
inline void panel_groups(Activations& a, int64_t M, int64_t g_begin, int64_t g_end) {
#if defined(NANOSERVE_AMX)
  if (!a.px.empty()) {
    for (int64_t r = g_begin * kPanelRows; r < std::min(M, g_end * kPanelRows); ++r) amx_panel_row(a, r);
    return;
  }
#endif
  const int64_t Kp = a.Kp;
  const bool super = superblock_int(a.qtype);
  const std::vector<int8_t>& q = super ? a.q256 : a.q;
  for (int64_t r = g_begin * kPanelRows; r < std::min(M, g_end * kPanelRows); ++r) {
    const int64_t grp = r / kPanelRows, lane = r % kPanelRows;
    const int8_t* src = q.data() + r * Kp;
    int8_t* dst = a.pq.data() + grp * Kp * kPanelRows + lane * 4;
    for (int64_t i = 0; i < Kp / 4; ++i) std::memcpy(dst + i * 4 * kPanelRows, src + 4 * i, 4);
    if (super) {
      const int64_t blocks = Kp / 256;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t at = grp * blocks + b;
        a.punit[at * kPanelRows + lane] = a.unit[r * blocks + b];
        for (int i = 0; i < 16; ++i) a.psums[(at * 16 + i) * kPanelRows + lane] = a.sums16[r * (Kp / 16) + b * 16 + i];
      }
    } else {
      const int64_t chunks = Kp / kChunk;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t at = (grp * chunks + c) * kPanelRows + lane;
        a.punit[at] = a.chunk_scale[r * chunks + c];
        a.psums[at] = a.chunk_sums[r * chunks + c];
      }
    }
  }
}

// Activations' panel fields from its row fields (M rows).
inline void build_panel(Activations& a, int64_t M) {
  size_panel(a, M);
  panel_groups(a, M, 0, (M + kPanelRows - 1) / kPanelRows);
}

template <typename T>
void quantize_activations(const T* x, int64_t M, int64_t K, int64_t Kp, int qtype, Activations& a) {
  size_activations(a, M, Kp, qtype);
  quantize_rows(x, 0, M, K, qtype, a);
}

// out = rows `rows[0 .. n)` of in, in that order, every field but the panel's (a row of each field is a fixed number
// of elements: Kp for q and q256, Kp / 32 for the chunk fields, Kp / 256 and Kp / 16 for unit and
// sums16; the super-block fields empty when in's are).
inline void gather_activations(const Activations& in, const int64_t* rows, int64_t n, Activations& out) {
  out.qtype = in.qtype;
  out.Kp = in.Kp;
  out.pq.clear();  // the panel fields: not gathered (build_panel makes them from the rest)
  out.punit.clear();
  out.psums.clear();
  const auto take = [&](const auto& from, auto& to, int64_t per_row) {
    to.resize(from.empty() ? 0 : n * per_row);
    if (from.empty()) return;
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(from.begin() + rows[i] * per_row, per_row, to.begin() + i * per_row);
  };
  const int64_t Kp = in.Kp;
  take(in.q, out.q, Kp);
  take(in.chunk_scale, out.chunk_scale, Kp / kChunk);
  take(in.chunk_sums, out.chunk_sums, Kp / kChunk);
  take(in.q256, out.q256, Kp);
  take(in.unit, out.unit, Kp / 256);
  take(in.sums16, out.sums16, Kp / 16);
}

// Vector v's int16 lanes of a super-block's sixteen scales s16 (IntScales): each pair of values
// (a maddubs lane) takes the scale of its 16 values. 512 bits: vector v is values 64v .. 64v + 63,
// lane l scale 4v + l / 8; 256 bits: values 32v .. 32v + 31, lanes 0-7 scale 2v, 8-15 scale 2v + 1.
inline IV spread_scales(__m256i s16, int v) {
#if defined(NANOSERVE_QUANT_ZMM)
  const __m512i lane = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006, 0x00090008, 0x000b000a,
                                         0x000d000c, 0x000f000e, 0x00110010, 0x00130012, 0x00150014, 0x00170016,
                                         0x00190018, 0x001b001a, 0x001d001c, 0x001f001e);  // int16 lane l holds l
  const __m512i index = _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(4 * v)), _mm512_srli_epi16(lane, 3));
  return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(s16));
#else
  const __m256i pair = _mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(v));  // scales 2v, 2v + 1 in each dword
  return _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3,
                                                    2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
#endif
}

// The exact int32 sums (wrapping, as every int32 step here) of a's lanes and of b's lanes, in
// lanes 0 and 1 of the result.
inline __m128i lane_sums2(__m256i a, __m256i b) {
  __m256i h = _mm256_hadd_epi32(a, b);  // a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7
  h = _mm256_hadd_epi32(h, h);
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
// The exact sums of the lanes of a, b, c and d, in lanes 0-3.
inline __m128i lane_sums4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The two int32 terms of a super-block of a (row of W, row of x) pair, and the fp32 steps that take
// them into the output (superblock_dot and quant_panel.h both end each super-block with them, so the
// two give the same bits):
//   acc = fma(float(term1), d * unit, acc);  acc = fma(float(term2), f2, acc)
// With raw_i the sum of u * qx over the 16 values of group i: for the formats with mins (q4_k,
// q5_k, q2_k), term1 = sum_i s16[i] * raw_i, term2 = sum_i m16[i] * sums16[i] and f2 = -dmin *
// unit; for the formats with an offset (q6_k, q3_k), term1 and term2 the sums of s16[i] * (raw_i -
// offset * sums16[i]) over the groups i with i / 2 even and odd (kTerm2Group) and f2 = d * unit.
// Each term is exact in int32 (|term| < 2^27 at the extremes of every format: with offset 32,
// |u - 32| <= 32 against |qx| <= 127, |s16| <= 128, eight groups a term).
inline float superblock_step(float acc, __m128i terms, float d_unit, float f2) {
  const __m128 t = _mm_cvtepi32_ps(terms);
  acc = std::fma(_mm_cvtss_f32(t), d_unit, acc);
  return std::fma(_mm_cvtss_f32(_mm_movehdup_ps(t)), f2, acc);
}
// superblock_step for two outputs side by side: lane j of acc, d_unit and f2 is output j's; terms
// holds term1 of outputs 0 and 1, then their term2. Lane by lane the same operations.
inline __m128 superblock_step2(__m128 acc, __m128i terms, __m128 d_unit, __m128 f2) {
  const __m128 t = _mm_cvtepi32_ps(terms);
  acc = _mm_fmadd_ps(t, d_unit, acc);
  return _mm_fmadd_ps(_mm_movehl_ps(t, t), f2, acc);
}
// Whether group i of 16 values is in term2 (the formats with an offset; see superblock_step).
constexpr bool kTerm2Group(int i) { return (i / 2) % 2 == 1; }

// dot_block for the superblock_int formats: x's rows as quantize_rows writes them (q256, step
// unit); per super-block and (row of W, row of x) the two terms of superblock_step, summed in
// int32 lanes (vpmaddubsw of W's u and qx, u <= 63 and |qx| <= 127: no saturation, then vpdpwssd,
// vpmaddwd + add on plain AVX2, against the scales s16 spread over the pairs; the offset as offset *
// s16 * sums16 by vpmaddwd and a shift, the mins by vpmaddwd), the lanes of each term summed exactly
// (512 bits: lanes 0-7 of every vector are term1's groups, 8-15 term2's; 256 bits: the even
// vectors term1's, the odd ones term2's), then superblock_step (superblock_step2 for two rows of W
// side by side). The integer sums are exact, so their order is free; each output's fp32 steps are
// superblock_step's, in super-block order, whatever NW and MX.
template <int Q, int NW, int MX>
void superblock_dot(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t m0, int64_t K,
                    float (*res)[4]) {
  static_assert(MX <= kRowsX && NW <= 4, "res holds kRowsX rows of 4 columns");
  using G = Group<Q>;
  constexpr int64_t bytes = layout(Q).bytes;
  constexpr bool mins = has_mins(Q);
  constexpr int offset = offset_of(Q);
  static_assert(offset == 0 || (offset & (offset - 1)) == 0, "offset * sums as a shift");
  constexpr int shift = offset == 0 ? 0 : __builtin_ctz(offset);
  constexpr int vectors = 256 / kVecValues;
  float acc[NW][MX] = {};
  __m128 acc2[MX];  // NW == 2: lane j is output (j, m)
  for (int m = 0; m < MX; ++m) acc2[m] = _mm_setzero_ps();
  for (int64_t k = 0; k < K; k += 256) {
    const int64_t g = k / 256;
    if constexpr (NW > 1)  // the next rows' same stretch, as in exact_chunk_dot
      for (int j = NW; j < 2 * NW; ++j)
        for (int64_t at = g * bytes; at < (g + 1) * bytes; at += 64) __builtin_prefetch(w + j * row_bytes + at, 0, 3);
    IntScales sc[NW];
    IV u[vectors][NW];
    for (int j = 0; j < NW; ++j) {
      const uint8_t* block = w + j * row_bytes + g * bytes;
      sc[j] = int_scales<Q>(block);
      const G grp(block);
#pragma GCC unroll 8
      for (int v = 0; v < vectors; ++v) u[v][j] = grp.uv(v);
    }
    for (int m = 0; m < MX; ++m) {
      const int64_t row = m0 + m;
      const float unit = a.unit[row * (K / 256) + g];
      const __m256i sums =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums16.data() + row * (K / 16) + k / 16));
      const __m256i minus_sums = _mm256_sub_epi16(_mm256_setzero_si256(), sums);
      __m256i sum1[NW], sum2[NW];  // the lanes of each output's two terms
      for (int j = 0; j < NW; ++j) {
        const __m256i s16 = sc[j].s16;
        // The offset formats' -offset * s16 * sums16 starts the sums: its lane i holds groups 2i and
        // 2i + 1, term1's for i even, term2's for i odd.
        __m256i start = _mm256_setzero_si256();
        if constexpr (!mins) start = _mm256_slli_epi32(_mm256_madd_epi16(s16, minus_sums), shift);
#if defined(NANOSERVE_QUANT_ZMM)
        IV isum = izero();
        if constexpr (!mins)  // even lanes to 0-3 (term1's half), odd ones to 8-11 (term2's)
          isum = _mm512_maskz_permutexvar_epi32(0x0f0f, _mm512_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0, 1, 3, 5, 7, 0, 0, 0, 0),
                                                _mm512_castsi256_si512(start));
#pragma GCC unroll 8
        for (int v = 0; v < vectors; ++v) {
          const IV xq = load_i(a.q256.data() + row * K + k + v * kVecValues);
          isum = dot2(isum, maddubs(u[v][j], xq), spread_scales(s16, v));
        }
        const __m256i t1 = _mm512_castsi512_si256(isum), t2 = _mm512_extracti64x4_epi64(isum, 1);
#else
        IV half[2] = {_mm256_blend_epi32(start, _mm256_setzero_si256(), 0xaa),
                      _mm256_blend_epi32(start, _mm256_setzero_si256(), 0x55)};
#pragma GCC unroll 8
        for (int v = 0; v < vectors; ++v) {
          const IV xq = load_i(a.q256.data() + row * K + k + v * kVecValues);
          half[v % 2] = dot2(half[v % 2], maddubs(u[v][j], xq), spread_scales(s16, v));
        }
        const __m256i t1 = half[0], t2 = half[1];
#endif
        if constexpr (mins) {
          sum1[j] = _mm256_add_epi32(t1, t2);
          sum2[j] = _mm256_madd_epi16(sc[j].m16, sums);
        } else {
          sum1[j] = t1;
          sum2[j] = t2;
        }
      }
      if constexpr (NW == 2) {  // both outputs' terms folded at once, their steps side by side
        const __m128 d = _mm_setr_ps(sc[0].d, sc[1].d, 0.0f, 0.0f);
        const __m128 d_unit = _mm_mul_ps(d, _mm_set1_ps(unit));
        const __m128 f2 = mins ? _mm_mul_ps(_mm_setr_ps(-sc[0].dmin, -sc[1].dmin, 0.0f, 0.0f), _mm_set1_ps(unit)) : d_unit;
        acc2[m] = superblock_step2(acc2[m], lane_sums4(sum1[0], sum1[1], sum2[0], sum2[1]), d_unit, f2);
      } else {
        for (int j = 0; j < NW; ++j)
          acc[j][m] = superblock_step(acc[j][m], lane_sums2(sum1[j], sum2[j]), sc[j].d * unit,
                                      mins ? -sc[j].dmin * unit : sc[j].d * unit);
      }
    }
  }
  for (int m = 0; m < MX; ++m) {
    if constexpr (NW == 2) {
      res[m][0] = _mm_cvtss_f32(acc2[m]);
      res[m][1] = _mm_cvtss_f32(_mm_movehdup_ps(acc2[m]));
    } else {
      for (int j = 0; j < NW; ++j) res[m][j] = acc[j][m];
    }
  }
}

// Lane c of the result: the exact int32 sum (wrapping, as every int32 step here) of the lanes of
// chunk c of dp, eight chunks (512 bits: chunk 2v in the low half of dp[v], 2v + 1 in the high).
inline __m256i chunk_sums8(const IV dp[8 * kChunk / kVecValues]) {
#if defined(NANOSERVE_QUANT_ZMM)
  // Three rounds of adding each even lane of (a, b) to the odd one after it (each round halves the
  // lanes a chunk spans), then the even int32 lanes (the low halves of the int64 lanes) in order.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const auto fold = [&](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
  };
  const __m512i f = fold(fold(dp[0], dp[1]), fold(dp[2], dp[3]));  // chunk c in lanes 2c, 2c + 1
  return _mm512_cvtepi64_epi32(_mm512_add_epi32(f, _mm512_shuffle_epi32(f, _MM_PERM_CDAB)));
#else
  // Each horizontal add sums adjacent lanes within 128-bit halves: after two rounds lane i of
  // h0123's low half holds the sum of dp[i]'s low half (i < 4), of its high half dp[i]'s high half's.
  const __m256i h0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(dp[0], dp[1]), _mm256_hadd_epi32(dp[2], dp[3]));
  const __m256i h4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(dp[4], dp[5]), _mm256_hadd_epi32(dp[6], dp[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20), _mm256_permute2x128_si256(h0123, h4567, 0x31));
#endif
}

// The low 16 bits of each int32 lane of v, in order.
inline __m128i low_halves(__m256i v) {
#if defined(__AVX512VL__)
  return _mm256_cvtepi32_epi16(v);
#else
  const __m256i packed = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
#endif
}

// The sum of an output's eight chunk accumulators (exact_chunks), in this order:
//   ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
inline float chunk_total(__m256 a) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// dot_block for exact_chunks: per chunk c and (row of W, row of x) the exact int32 sum of its 32
// products (the lanes of dot4 summed by chunk_sums8, less offset * the chunk's sum of qx), then the
// fp32 steps into the output's accumulator c % 8, in chunk order from zero:
//   acc[c % 8] = fma(float(sum_c), d_c * dx_c, acc[c % 8])
//   acc[c % 8] = fma(float(qsum_c), m_c * dx_c, acc[c % 8])   (q4_1, q5_1: the block's min m times
//                                                              the chunk's sum of qx)
// (|sum_c| <= 32 * 127 * 127 < 2^24: the conversions are exact), and chunk_total at the end. Each
// output's fp32 operations are these, whatever NW and MX; quant_panel.h's kernel takes the same ones
// lane by lane.
template <int Q, int NW, int MX>
void exact_chunk_dot(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t m0, int64_t K,
                     float (*res)[4]) {
  static_assert(MX <= kRowsX && NW <= 4, "res holds kRowsX rows of 4 columns");
  using G = Group<Q>;
  constexpr int64_t bytes = layout(Q).bytes, chunk_bytes = bytes * kChunk / layout(Q).values;
  constexpr bool mins = has_lane_mins(Q);
  constexpr int offset = offset_of(Q);
  static_assert(offset == 0 || (offset & (offset - 1)) == 0, "offset * sums as a shift");
  constexpr int shift = offset == 0 ? 0 : __builtin_ctz(offset);
  constexpr int per_vector = kVecValues / kChunk, vectors = 8 / per_vector;  // eight chunks a step
  const int64_t Kp = a.Kp, chunks = K / kChunk;
  __m256 acc[NW][MX];  // lane r: the chunks c % 8 == r
  for (int j = 0; j < NW; ++j)
    for (int m = 0; m < MX; ++m) acc[j][m] = _mm256_setzero_ps();
  const int tail = static_cast<int>(chunks % 8);
  const __m256i iota8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Chunks [c0, c0 + n): n = 8 (whole, a compile-time true: the loops unrolled, no bounds) but for
  // the last step of a K that is not a multiple of 256, n = tail (whose missing chunks add 0 * 0: d,
  // m, dx and the sums zero there, and an accumulator is never -0).
  const auto step = [&](int64_t c0, auto whole) {
    const int n = whole ? 8 : tail;
    // With several rows of W: the same stretch of the next NW rows (the next call's, or the next
    // task's: rows follow one another in memory), a cache line at a time, since the hardware
    // prefetcher does not run far enough ahead on NW interleaved streams. One row of W is one
    // sequential stream, prefetched by column_range where the hardware prefetcher falls behind.
    if constexpr (NW > 1)
      for (int j = NW; j < 2 * NW; ++j)
        for (int64_t at = c0 * chunk_bytes; at < (c0 + n) * chunk_bytes; at += 64)
          __builtin_prefetch(w + j * row_bytes + at, 0, 3);
    IV u[vectors][NW];
    __m256 d[NW], mn[NW];  // mn: mins only
    for (int j = 0; j < NW; ++j) {
      const uint8_t* row = w + j * row_bytes + c0 * chunk_bytes;
      if constexpr (Q == kIQ4_XS) {  // the step is one block (K a multiple of 256: n == 8)
        const G g(row);
        d[j] = g.scale8;
#pragma GCC unroll 8
        for (int v = 0; v < vectors; ++v) u[v][j] = g.uv(v);
      } else {  // the first four bytes of each of the n blocks, d (and q4_1's / q5_1's m) in one gather
        const __m256i at = _mm256_mullo_epi32(iota8, _mm256_set1_epi32(bytes));
        const int* base = reinterpret_cast<const int*>(row);
        const __m256i dm = whole ? _mm256_i32gather_epi32(base, at, 1)
                                 : _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base, at,
                                                               _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota8), 1);
        d[j] = _mm256_cvtph_ps(low_halves(dm));
        if constexpr (mins) mn[j] = _mm256_cvtph_ps(low_halves(_mm256_srli_epi32(dm, 16)));
        for (int v = 0; v < vectors; ++v) {
          const int c = v * per_vector;
#if defined(NANOSERVE_QUANT_ZMM)
          u[v][j] = c < n ? G::pair_u(row + c * bytes, c + 1 < n ? row + (c + 1) * bytes : nullptr) : izero();
#else
          u[v][j] = c < n ? G(row + c * bytes).u(0) : izero();
#endif
        }
      }
    }
    for (int m = 0; m < MX; ++m) {
      const int64_t at = (m0 + m) * Kp + c0 * kChunk;
      __m256 dx8;
      __m256i qsum;  // each chunk's sum of qx
      if (whole) {
        dx8 = _mm256_loadu_ps(a.chunk_scale.data() + at / kChunk);
        qsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.chunk_sums.data() + at / kChunk));
      } else {
        alignas(32) float dx[8] = {};
        alignas(32) int32_t sums[8] = {};
        std::copy_n(a.chunk_scale.data() + at / kChunk, n, dx);
        std::copy_n(a.chunk_sums.data() + at / kChunk, n, sums);
        dx8 = _mm256_load_ps(dx);
        qsum = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums));
      }
      const __m256i off = _mm256_slli_epi32(qsum, shift);  // offset * sum of qx (offset 0: unused)
      for (int j = 0; j < NW; ++j) {
        IV dp[vectors];
        for (int v = 0; v < vectors; ++v) {
          if (v * per_vector >= n) {
            dp[v] = izero();
            continue;
          }
          const IV xq = load_i(a.q.data() + at + v * kVecValues);
          dp[v] = kSignTrick && signed_values(Q) ? dot4(izero(), abs8(xq), sign_mul(u[v][j], xq))
                                                 : dot4(izero(), u[v][j], xq);
        }
        __m256i sums = chunk_sums8(dp);
        if constexpr (offset != 0) sums = _mm256_sub_epi32(sums, off);
        acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d[j], dx8), acc[j][m]);
        if constexpr (mins) acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qsum), _mm256_mul_ps(mn[j], dx8), acc[j][m]);
      }
    }
  };
  int64_t c0 = 0;
  for (; c0 + 8 <= chunks; c0 += 8) step(c0, std::true_type{});
  if (c0 < chunks) step(c0, std::false_type{});
  for (int j = 0; j < NW; ++j)
    for (int m = 0; m < MX; ++m) res[m][j] = chunk_total(acc[j][m]);
}

// res[m][j] = x_m . w_j for MX activation rows (from row m0) and NW rows of W (from w, row_bytes apart).
template <int Q, int NW, int MX>
void dot_block(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t m0, int64_t K, float (*res)[4]) {
  if constexpr (superblock_int(Q))
    superblock_dot<Q, NW, MX>(w, row_bytes, a, m0, K, res);
  else
    exact_chunk_dot<Q, NW, MX>(w, row_bytes, a, m0, K, res);
}

// Output columns [n0, n0 + NW) for rows [m_begin, m_end) of x, up to kRowsX rows of x at a time.
template <int Q, int NW, typename T, typename O>
void columns(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, O* out, int64_t out_stride,
             int64_t m_begin, int64_t m_end, int64_t K, int64_t n0) {
  float res[kRowsX][4] = {};  // (initialised only to quiet -Wmaybe-uninitialized)
  const uint8_t* w0 = w + n0 * row_bytes;
  for (int64_t m0 = m_begin, mx; m0 < m_end; m0 += mx) {
    mx = std::min<int64_t>(kRowsX, m_end - m0);
    switch (mx) {
      case 8: dot_block<Q, NW, 8>(w0, row_bytes, a, m0, K, res); break;
      case 7: dot_block<Q, NW, 7>(w0, row_bytes, a, m0, K, res); break;
      case 6: dot_block<Q, NW, 6>(w0, row_bytes, a, m0, K, res); break;
      case 5: dot_block<Q, NW, 5>(w0, row_bytes, a, m0, K, res); break;
      case 4: dot_block<Q, NW, 4>(w0, row_bytes, a, m0, K, res); break;
      case 3: dot_block<Q, NW, 3>(w0, row_bytes, a, m0, K, res); break;
      case 2: dot_block<Q, NW, 2>(w0, row_bytes, a, m0, K, res); break;
      default: dot_block<Q, NW, 1>(w0, row_bytes, a, m0, K, res); break;
    }
    for (int64_t m = 0; m < mx; ++m)
      for (int j = 0; j < NW; ++j)
        from_float(res[m][j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.0f), out + (m0 + m) * out_stride + n0 + j);
  }
}

}  // namespace

#endif

#include "quant_panel.h"
#include "quant_amx.h"

#if defined(__AVX2__)

namespace {

// How far ahead of the row it multiplies the one-row path prefetches W (bytes), and whether it does:
// on Intel cores only. Their L2 streamer keeps only a few lines ahead of one stream, which the row's
// arithmetic then waits for (on a Sapphire Rapids core W came from memory at half the rate of either
// the arithmetic alone or a bare read); AMD's (Zen 4) follow one stream at the rate memory delivers,
// and software prefetches there only cost issue slots (docs/quantization.md, "Streaming").
constexpr int64_t kOneRowPrefetch = 2048;
inline bool one_row_prefetch() {
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
}

// Output columns [begin, end) for all M rows of x, in out's row m at out + m * out_stride. At one
// row of x (single-stream decode, where W's bytes cost more than the arithmetic) one row of W at a
// time: each row is one sequential stream, which the hardware prefetcher follows at the rate memory
// delivers (several rows read side by side are several streams, which it follows at about half
// that rate), helped on Intel cores by software prefetches kOneRowPrefetch bytes ahead (a
// prefetch never faults, so those past the end of W are harmless). There, with the prefetches
// leading, the superblock_int formats take two adjacent rows of W at a time (one stretch of
// memory, prefetched as one): the two outputs share superblock_dot's folding and fp32 steps
// (superblock_step2), the larger part of a row's instructions at one row of x. With more rows of x
// (the arithmetic's cost), W's rows in pairs: each load of x serves two; for the 32-value formats
// (and iq4_xs) a block of kRowsX rows of x against each pair of the range in turn (x's block stays
// in L1, the range's rows of W in L2), for the superblock_int formats each pair against all rows of
// x in turn.
template <int Q, typename T, typename O>
void column_range(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, O* out,
                  int64_t out_stride, int64_t M, int64_t K, int64_t begin, int64_t end) {
#if defined(NANOSERVE_AMX)
  if constexpr (superblock_int(Q))
    if (!a.px.empty()) return amx_range<Q>(w, row_bytes, a, bias, out, out_stride, M, K, begin, end);
#endif
  if (!a.pq.empty()) return panel_range<Q>(w, row_bytes, a, bias, out, out_stride, M, K, begin, end);
  if (M == 1) {
    const bool prefetch = one_row_prefetch();
    const auto store = [&](int64_t n, float sum) {
      from_float(sum + (bias != nullptr ? to_float(bias[n]) : 0.0f), out + n);
    };
    int64_t n = begin;
    float res[1][4];
    if constexpr (superblock_int(Q)) {
      for (; prefetch && n + 2 <= end; n += 2) {
        for (int64_t at = 0; at < 2 * row_bytes; at += 64)
          __builtin_prefetch(w + n * row_bytes + kOneRowPrefetch + at, 0, 3);
        dot_block<Q, 2, 1>(w + n * row_bytes, row_bytes, a, 0, K, res);
        store(n, res[0][0]);
        store(n + 1, res[0][1]);
      }
    }
    for (; n < end; ++n) {
      if (prefetch)
        for (int64_t at = 0; at < row_bytes; at += 64)
          __builtin_prefetch(w + n * row_bytes + kOneRowPrefetch + at, 0, 3);
      dot_block<Q, 1, 1>(w + n * row_bytes, row_bytes, a, 0, K, res);
      store(n, res[0][0]);
    }
    return;
  }
  // Columns [n, n + 2) (the range's last one alone if odd) for rows [m_begin, m_end) of x.
  const auto pair = [&](int64_t n, int64_t m_begin, int64_t m_end) {
    if (n + 2 <= end)
      columns<Q, 2>(w, row_bytes, a, bias, out, out_stride, m_begin, m_end, K, n);
    else
      columns<Q, 1>(w, row_bytes, a, bias, out, out_stride, m_begin, m_end, K, n);
  };
  if constexpr (superblock_int(Q)) {  // each pair of W's rows against every row of x
    for (int64_t n = begin; n < end; n += 2) pair(n, 0, M);
  } else {  // each block of x's rows (from L1) against every row of W in the range (from L2)
    for (int64_t m0 = 0; m0 < M; m0 += kRowsX)
      for (int64_t n = begin; n < end; n += 2) pair(n, m0, std::min<int64_t>(m0 + kRowsX, M));
  }
}

}  // namespace

#endif
