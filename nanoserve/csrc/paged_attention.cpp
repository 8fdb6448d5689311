// Paged attention on the CPU, straight from the block pool: decodes, drafts and prefill chunks alike.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there).
//
// Query token i of a sequence with q_len new tokens and seq_len tokens in all sees the keys at
// positions <= seq_len - q_len + i (causal among the new tokens). A sequence's new tokens are cut
// into tiles of at most kTileTokens consecutive tokens (a decode, or a query of up to kTileTokens
// tokens, is one tile), and the tiles of all sequences are the work items, shared among
// `num_threads` OpenMP threads (with fewer than two tiles a thread, as a single sequence's decode,
// each tile's KV heads are split among several items); each item writes only its own rows of out.
// An item's query rows (each of its tokens times each of its query heads) are attended in one pass
// over the blocks that its last token can see: each block's keys and values are read once per item,
// for each KV head serving all the query heads that share it (GQA) and all the tile's tokens, while
// the item's queries and accumulators stay in L1/L2. Softmax is online (flash-decoding): per block
// and row, the scores, one rescale of the accumulator, then the weighted sum of the block's values,
// all in fp32, the softmax's vectors of 16 with AVX-512. A bf16 cache's scores come, where the build
// has AVX512-BF16, from vdpbf16ps on the stored bf16 query and keys (the scale applied to each sum)
// in one order of operations whatever the rows (a decode's few rows key by key, 16 keys' partial
// sums reduced together; a tile's many against the block's keys transposed once); elsewhere from fp32
// FMAs on widened values. Its values are widened to fp32 (once per block into a buffer when
// kWidenRows rows or more use them, else at each use, once for all the rows of a KV head that a
// pass holds: the same floats), and only the result is rounded to bf16. A row's arithmetic does not
// depend on how its sequence was tiled or its heads split (a decode's row equals the same row in a
// prefill chunk, bit for bit). The running maxima start at a finite sentinel, so no infinity enters
// the arithmetic.
//
// Layouts: q [num_tokens, num_heads, head_dim] with its tokens q_stride elements apart (q may be
// the q columns of a fused qkv tensor); everything else contiguous: out [num_tokens, num_heads,
// head_dim]; the layer's cache [2, num_blocks, block_size, num_kv_heads, head_dim] (K plane, then V
// plane); block_tables [num_seqs, table_stride]; seq_lens [num_seqs]; query_start [num_seqs + 1].
//
// `write_kv` stores a step's new K and V (rows k_stride and v_stride elements apart) at their flat
// slots (block * block_size + offset) before attention reads them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "simd.h"

namespace {

using namespace nanoserve;

constexpr float kMasked = -1e30f;  // the running maximum before any key

// A block's keys (or values) for one KV head, as rows of NVEC vectors of float: row t starts at base
// + t * stride elements of E, float (a float cache, or a bfloat16 block widened into a buffer by
// block_rows) or bfloat16 (read from the cache and widened at each use).
template <typename E, int NVEC>
struct Rows {
  const E* base;
  int64_t stride;
  vec8 at(int t, int j) const { return load8(base + t * stride + j * kLanes); }
};

template <int NVEC>
Rows<float, NVEC> block_rows(const float* src, int64_t token_stride, int /*n*/, vec8* /*buf*/) {
  return {src, token_stride};
}

template <int NVEC>
Rows<float, NVEC> block_rows(const uint16_t* src, int64_t token_stride, int n, vec8* buf) {
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < NVEC; ++j) buf[t * NVEC + j] = load8(src + t * token_stride + j * kLanes);
  return {reinterpret_cast<const float*>(buf), NVEC * kLanes};
}

// s[t] = q . k[t] for t < n: four keys at a time, so four independent FMA chains are in flight.
template <typename E, int NVEC>
inline void dot_keys(const vec8* q, const Rows<E, NVEC>& k, int n, float* s) {
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    vec8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int j = 0; j < NVEC; ++j) {
      a0 += q[j] * k.at(t, j);
      a1 += q[j] * k.at(t + 1, j);
      a2 += q[j] * k.at(t + 2, j);
      a3 += q[j] * k.at(t + 3, j);
    }
    s[t] = hsum(a0), s[t + 1] = hsum(a1), s[t + 2] = hsum(a2), s[t + 3] = hsum(a3);
  }
  for (; t < n; ++t) {
    vec8 a = {};
    for (int j = 0; j < NVEC; ++j) a += q[j] * k.at(t, j);
    s[t] = hsum(a);
  }
}

#if defined(__AVX512BF16__)
// Whether a cache of element type T takes its scores from bfloat16 pairs (vdpbf16ps: each pair's
// products exact, summed into fp32) against the query's own bfloat16 values, then scaled.
template <typename T>
constexpr bool kBf16Scores = std::is_same_v<T, uint16_t>;

// The bf16 scores of up to 16 keys at a time, in one order of operations whichever of the two forms
// below computes them, so that a row's scores do not depend on how many rows share its KV head (a
// decode's few rows take the first form, a prefill tile's many the second): accumulator l of 16
// (l = 0..15) starts at zero and takes, by vdpbf16ps, the query-key products of the head's bfloat16
// pairs l, l + 16, l + 32, ... in that order; then B_l = A_l + A_{l+8}, C_l = B_l + B_{l+4}, D_l =
// C_l + C_{l+2}, and the score is (D_0 + D_1) times the scale.
inline __m512bh bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// Lane t of the result: the accumulators of key t, a[t]'s 16 lanes, summed in the order above.
inline __m512 lane_sums(const __m512* a) {
  const auto lo64 = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  const auto hi64 = [](__m512 x, __m512 y) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y)));
  };
  __m512 c[4];  // c[m]'s 128-bit lane j: C_0..C_3 of key 4j + m
  for (int m = 0; m < 4; ++m) {
    const __m512 x = a[m], y = a[4 + m], z = a[8 + m], w = a[12 + m];
    const __m512 bxy = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    const __m512 bzw = _mm512_add_ps(_mm512_shuffle_f32x4(z, w, 0x44), _mm512_shuffle_f32x4(z, w, 0xEE));
    c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(bxy, bzw, 0x88), _mm512_shuffle_f32x4(bxy, bzw, 0xDD));
  }
  const __m512 d01 = _mm512_add_ps(lo64(c[0], c[1]), hi64(c[0], c[1]));  // D_0, D_1 of keys 4j, 4j + 1
  const __m512 d23 = _mm512_add_ps(lo64(c[2], c[3]), hi64(c[2], c[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(d01, d23, 0x88), _mm512_shuffle_ps(d01, d23, 0xDD));
}

// First form, key by key: s[t] = scale * (q . k[t]) for t < n <= 16 (s has 16 places; those from n
// on are zeros times the scale), the query and the keys read as stored; four keys at a time.
template <int NVEC>
inline void scores_by_key(const uint16_t* q, const Rows<uint16_t, NVEC>& k, int n, float scale, float* s) {
  constexpr int QN = NVEC / 4;  // vectors of 32 bfloat16 values a head
  const auto key = [&](int t, int j) { return bf16x32(k.base + t * k.stride + j * 32); };
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (int t = 0; t < n; t += 4) {  // keys past n in the last four: computed, then dropped
    __m512 a0 = a[t], a1 = a0, a2 = a0, a3 = a0;
    for (int j = 0; j < QN; ++j) {
      const __m512bh qj = bf16x32(q + j * 32);
      a0 = _mm512_dpbf16_ps(a0, qj, key(t, j));
      if (t + 1 < n) a1 = _mm512_dpbf16_ps(a1, qj, key(t + 1, j));
      if (t + 2 < n) a2 = _mm512_dpbf16_ps(a2, qj, key(t + 2, j));
      if (t + 3 < n) a3 = _mm512_dpbf16_ps(a3, qj, key(t + 3, j));
    }
    a[t] = a0, a[t + 1] = a1, a[t + 2] = a2, a[t + 3] = a3;
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(lane_sums(a), _mm512_set1_ps(scale)));
}

// out[c] holds column c of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15] (r is
// overwritten).
inline void transpose16(__m512i* r, __m512i* out) {
  __m512i u[16];
  for (int i = 0; i < 8; ++i) {  // u[2i], 128-bit lane c: elements 4c, 4c + 1 of rows 2i, 2i + 1
    u[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane c: element 4c + e of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(u[4 * i], u[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(u[4 * i], u[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(u[4 * i + 1], u[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(u[4 * i + 1], u[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
    out[e] = _mm512_shuffle_i32x4(x0, y0, 0x88), out[8 + e] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[4 + e] = _mm512_shuffle_i32x4(x1, y1, 0x88), out[12 + e] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// The second form's keys: kt[p] holds bfloat16 pair p of keys 0..15 (zeros for keys n and above),
// for the 16 QN pairs of a head; a 16 x 16 transpose of 32-bit pairs per 32 values.
template <int NVEC>
inline void transpose_keys(const Rows<uint16_t, NVEC>& k, int n, __m512i* kt) {
  constexpr int QN = NVEC / 4;
  for (int j = 0; j < QN; ++j) {
    __m512i r[16];
    for (int t = 0; t < 16; ++t)
      r[t] = t < n ? _mm512_loadu_si512(k.base + t * k.stride + j * 32) : _mm512_setzero_si512();
    transpose16(r, kt + j * 16);
  }
}

// Second form, 16 keys at once from transposed keys: s[t] = scale * (q . k[t]) for t < 16, each
// query pair broadcast against the 16 keys' pairs, the same operations lane by lane as the first.
template <int NVEC>
inline void scores_transposed(const uint16_t* q, const __m512i* kt, float scale, float* s) {
  constexpr int QN = NVEC / 4;
  __m512 a[16];
  for (int l = 0; l < 16; ++l) a[l] = _mm512_setzero_ps();
  for (int j = 0; j < QN; ++j)
    for (int l = 0; l < 16; ++l) {
      int32_t pair;
      std::memcpy(&pair, q + 2 * (16 * j + l), sizeof pair);
      a[l] = _mm512_dpbf16_ps(a[l], (__m512bh)_mm512_set1_epi32(pair), (__m512bh)kt[16 * j + l]);
    }
  for (int l = 0; l < 8; ++l) a[l] = _mm512_add_ps(a[l], a[l + 8]);
  for (int l = 0; l < 4; ++l) a[l] = _mm512_add_ps(a[l], a[l + 4]);
  for (int l = 0; l < 2; ++l) a[l] = _mm512_add_ps(a[l], a[l + 2]);
  _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_add_ps(a[0], a[1]), _mm512_set1_ps(scale)));
}

#else
template <typename T>
constexpr bool kBf16Scores = false;
#endif

// For each of `rows` rows r: acc_r = acc_r * rescale[r] + sum_t p_r[t] v[t] for t < n (acc_r at acc +
// r * NVEC, p_r at p + r * p_stride), each value's operations the same on every path and whatever the
// rows (the product by rescale, then one FMA per t in order). With AVX-512 in vectors of 16 floats,
// up to eight of a row at a time kept in registers across the block's values, for as many rows
// together as 16 registers hold (each value read, and a bfloat16 one widened, once for them all);
// else eight vectors of eight at a time, row by row.
#if defined(__AVX512F__)
template <int R, typename E, int NVEC>
inline void accumulate_rows(float* acc, const Rows<E, NVEC>& v, const float* p, int64_t p_stride,
                            const float* rescale, int n) {
  static_assert(NVEC % 2 == 0, "head sizes are multiples of 16");
  constexpr int kWide = NVEC / 2, kChunk = kWide < 8 ? kWide : 8;  // vectors of 16 a row, a pass's
  static_assert(kWide % kChunk == 0, "head sizes are 32 or multiples of 64");
  const auto at = [&](int t, int i) {  // values 16i .. 16i + 15 of row t as floats
    const E* src = v.base + t * v.stride + i * 16;
    if constexpr (std::is_same_v<E, float>)
      return _mm512_loadu_ps(src);
    else  // bfloat16: the bits shifted into the upper half of each float
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16));
  };
  for (int j = 0; j < kWide; j += kChunk) {
    __m512 c[R][kChunk];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kChunk; ++i)
        c[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * NVEC * kLanes + (j + i) * 16), _mm512_set1_ps(rescale[r]));
    for (int t = 0; t < n; ++t) {
      __m512 pt[R];
      for (int r = 0; r < R; ++r) pt[r] = _mm512_set1_ps(p[r * p_stride + t]);
      for (int i = 0; i < kChunk; ++i) {
        const __m512 vi = at(t, j + i);
        for (int r = 0; r < R; ++r) c[r][i] = _mm512_fmadd_ps(pt[r], vi, c[r][i]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kChunk; ++i) _mm512_storeu_ps(acc + r * NVEC * kLanes + (j + i) * 16, c[r][i]);
  }
}

template <typename E, int NVEC>
inline void accumulate_values(vec8* acc, const Rows<E, NVEC>& v, const float* p, int64_t p_stride,
                              const float* rescale, int rows, int n) {
  constexpr int kChunk = NVEC / 2 < 8 ? NVEC / 2 : 8, kRows = 16 / kChunk;  // rows sharing each value
  float* out = reinterpret_cast<float*>(acc);
  const auto row = [&](int r) { return out + r * NVEC * kLanes; };
  int r = 0;
  for (; r + kRows <= rows; r += kRows) accumulate_rows<kRows>(row(r), v, p + r * p_stride, p_stride, rescale + r, n);
  if constexpr (kRows > 2)
    for (; r + 2 <= rows; r += 2) accumulate_rows<2>(row(r), v, p + r * p_stride, p_stride, rescale + r, n);
  for (; r < rows; ++r) accumulate_rows<1>(row(r), v, p + r * p_stride, p_stride, rescale + r, n);
}
#else
template <typename E, int NVEC>
inline void accumulate_values(vec8* acc, const Rows<E, NVEC>& v, const float* p, int64_t p_stride,
                              const float* rescale, int rows, int n) {
  constexpr int kChunk = NVEC < 8 ? NVEC : 8;
  static_assert(NVEC % kChunk == 0, "head sizes are 32 or multiples of 64");
  for (int r = 0; r < rows; ++r, acc += NVEC, p += p_stride)
    for (int j = 0; j < NVEC; j += kChunk) {
      vec8 c[kChunk];
      for (int i = 0; i < kChunk; ++i) c[i] = acc[j + i] * rescale[r];
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < kChunk; ++i) c[i] += p[t] * v.at(t, j + i);
      for (int i = 0; i < kChunk; ++i) acc[j + i] = c[i];
    }
}
#endif

template <typename T>
inline void load_query(const T* src, float scale, vec8* dst, int nvec);
template <>
inline void load_query(const float* src, float scale, vec8* dst, int nvec) {
  for (int j = 0; j < nvec; ++j) dst[j] = *reinterpret_cast<const uvec8*>(src + j * kLanes) * scale;
}
template <>
inline void load_query(const uint16_t* src, float scale, vec8* dst, int nvec) {
  for (int j = 0; j < nvec; ++j) dst[j] = load8(src + j * kLanes) * scale;
}

// Scores are handled in vectors of 16 where the build has AVX-512, else of 8 (`scores` has room for
// whole vectors of 16).
#if defined(__AVX512F__)
using Scores = vec16;
#else
using Scores = vec8;
#endif

// The online softmax's step over one block: s[t] for t < visible become e^(s[t] - m') (m' the new
// running maximum, max(m, s[t])), the lanes past them zeros; l becomes l * e^(m - m') + their sum and
// m becomes m'; returns e^(m - m'), by which the row's accumulator is rescaled (exactly 1 when the
// maximum stays).
template <typename V>
inline float softmax_block(float* s, int visible, float& m, float& l) {
  constexpr int L = sizeof(V) / sizeof(float);
  V lane;
  for (int j = 0; j < L; ++j) lane[j] = static_cast<float>(j);
  V top = V{} + m;
  for (int t = 0; t < visible; t += L) {
    V e;
    std::memcpy(&e, s + t, sizeof e);
    e = lane < static_cast<float>(visible - t) ? e : V{} + kMasked;  // past the visible keys
    top = top > e ? top : e;
  }
  const float m_new = hmax(top);
  const float rescale = m_new == m ? 1.0f : exp_nonpositive(V{} + (m - m_new))[0];
  V sum = {};
  for (int t = 0; t < visible; t += L) {
    V e;
    std::memcpy(&e, s + t, sizeof e);
    e = lane < static_cast<float>(visible - t) ? exp_nonpositive(e - m_new) : V{};
    std::memcpy(s + t, &e, sizeof e);
    sum += e;
  }
  l = l * rescale + hsum(sum);
  m = m_new;
  return rescale;
}

// n rows of `bytes` bytes, `stride` elements of T apart from p, prefetched for reading into the cache
// level that Locality names (__builtin_prefetch's: 3 L1, 2 L2).
template <int Locality, typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t n, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + t * stride) + off, 0, Locality);
}

// New tokens per tile. 16 tokens of 4 query heads of 64 keep a tile's queries and
// accumulators at 32 KiB; a query of at most this many tokens (a decode, a decode carrying up to 15
// drafts, a short prefill chunk) is one tile and reads its sequence's K and V once.
constexpr int64_t kTileTokens = 16;

// Query rows per KV head (a tile's tokens times the heads sharing it) from which a bfloat16 block's
// values (and keys, without bf16 scores) are widened to float once into a buffer; below, at each
// use (a widening load and a shift, against a store and a load per use from the buffer).
constexpr int64_t kWidenRows = 4;

// Query rows per KV head from which bf16 scores take each block's keys transposed (the second form:
// a transpose per block and head, against a horizontal sum per row and 16 keys in the first).
constexpr int64_t kTransposeRows = 8;

// Attends the query rows of new tokens [tok_begin, tok_end) of one sequence and KV heads [kv_begin,
// kv_end): row r is new token tok_begin + r / heads and query head kv_begin * group + r % heads (heads
// = (kv_end - kv_begin) * group query heads), reading KV head kv_begin + (r % heads) / group. The
// blocks up to the one holding the last key that token tok_end - 1 sees are walked once, each one's
// K and V of those heads read once, and the next block's prefetched meanwhile (block tables scatter
// blocks, which hardware prefetchers cannot follow).
template <typename T, int NVEC>
void attend_tile(const T* q, int64_t q_stride, const T* cache, T* out, const int64_t* table, int64_t seq_len,
                 int64_t q_start, int64_t q_len, int64_t tok_begin, int64_t tok_end, int64_t kv_begin,
                 int64_t kv_end, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t num_blocks,
                 float scale) {
  constexpr int64_t head_dim = NVEC * kLanes;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_len = tok_end - tok_begin, heads = (kv_end - kv_begin) * group, head0 = kv_begin * group;
  const int rows = static_cast<int>(tile_len * heads);
  const int64_t v_plane = num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_elems = block_size * token_stride;
  const int64_t head_bytes = head_dim * static_cast<int64_t>(sizeof(T));  // a token's K (or V) of one head
  // Whether values are read from the cache at each use (float, or bfloat16 with few rows a KV head),
  // not widened into a buffer first.
  const bool in_place_values = std::is_same_v<T, float> || tile_len * group < kWidenRows;

  // Each row's query: its head_dim values as stored (bf16 scores; the scale enters each score), else
  // NVEC vectors of float times scale.
  std::vector<vec8> qv(kBf16Scores<T> ? 0 : static_cast<size_t>(rows) * NVEC);
  std::vector<uint16_t> qb(kBf16Scores<T> ? static_cast<size_t>(rows) * head_dim : 0);
  std::vector<vec8> acc(static_cast<size_t>(rows) * NVEC);
  // The scores of one block of a token's rows of one KV head (its query heads i of the group) at
  // scores[i * padded]: room for whole vectors of 16 (the bf16 forms' unit) and of kLanes.
  const int64_t padded = (block_size + 15) / 16 * 16;
  std::vector<float> m(rows, kMasked), l(rows, 0.0f), scores(group * padded), rescale(group);
#if defined(__AVX512BF16__)
  // bf16 scores of many rows a KV head: each block's keys transposed once for them all.
  const bool transposed = kBf16Scores<T> && tile_len * group >= kTransposeRows;
  std::vector<__m512i> kt(transposed ? padded * NVEC / 4 : 0);
#endif
  std::vector<vec8> kbuf(std::is_same_v<T, float> || kBf16Scores<T> ? 0 : block_size * NVEC);
  std::vector<vec8> vbuf(std::is_same_v<T, float> ? 0 : block_size * NVEC);
  const int64_t first_token = q_start + tok_begin;  // the tile's first row of q and of out
  for (int r = 0; r < rows; ++r) {  // token-major, then head, as out is laid out
    const T* src = q + (first_token + r / heads) * q_stride + (head0 + r % heads) * head_dim;
    if constexpr (kBf16Scores<T>)
      std::memcpy(qb.data() + r * head_dim, src, head_dim * sizeof(T));
    else
      load_query(src, scale, qv.data() + r * NVEC, NVEC);
  }

  const int64_t first_limit = seq_len - q_len;  // the last key that new token 0 may see
  // Through the block of the last key the tile's last token sees; none for an empty sequence.
  const int64_t nblk = seq_len == 0 ? 0 : (first_limit + tok_end - 1) / block_size + 1;
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t first = b * block_size;
    const int n = static_cast<int>(std::min<int64_t>(block_size, seq_len - first));
    for (int64_t h = kv_begin; h < kv_end; ++h) {
      const T* kb = cache + table[b] * block_elems + h * head_dim;
      const T* vb = kb + v_plane;
      // Prefetched a head at a time (a whole block's lines for every head at once stall the core on
      // its outstanding misses): the next block's K and V of this head into L2 (a block's K and V
      // outsize L1); and this block's values of this head into L1 while its scores are computed, when
      // they are read in place.
      if (b + 1 < nblk) {
        const T* next = cache + table[b + 1] * block_elems + h * head_dim;
        prefetch_rows<2>(next, token_stride, block_size, head_bytes);
        prefetch_rows<2>(next + v_plane, token_stride, block_size, head_bytes);
      }
      if (in_place_values) prefetch_rows<3>(vb, token_stride, n, head_bytes);
#if defined(__AVX512BF16__)
      if constexpr (kBf16Scores<T>)
        if (transposed)
          for (int g = 0; g < n; g += 16)
            transpose_keys(Rows<uint16_t, NVEC>{kb + g * token_stride, token_stride}, std::min(16, n - g),
                           kt.data() + g * NVEC / 4);
#endif
      // The tile's rows of KV head h against its keys and values in this block: a token's rows of
      // this head (the query heads that share it) scored, then their values accumulated together.
      const auto attend_head = [&](const auto& keys, const auto& values) {
        for (int64_t tok = 0; tok < tile_len; ++tok) {
          const int visible =
              static_cast<int>(std::clamp<int64_t>(first_limit + tok_begin + tok - first + 1, 0, n));
          if (visible == 0) continue;
          const int64_t row0 = tok * heads + (h - kv_begin) * group;
          for (int64_t i = 0; i < group; ++i) {
            const int64_t r = row0 + i;
            float* s = scores.data() + i * padded;
#if defined(__AVX512BF16__)
            if constexpr (kBf16Scores<T>) {
              for (int g = 0; g < visible; g += 16) {
                if (transposed)
                  scores_transposed<NVEC>(qb.data() + r * head_dim, kt.data() + g * NVEC / 4, scale, s + g);
                else
                  scores_by_key(qb.data() + r * head_dim,
                                Rows<uint16_t, NVEC>{keys.base + g * keys.stride, keys.stride},
                                std::min(16, visible - g), scale, s + g);
              }
            } else {
              dot_keys(qv.data() + r * NVEC, keys, visible, s);
            }
#else
            dot_keys(qv.data() + r * NVEC, keys, visible, s);
#endif
            rescale[i] = softmax_block<Scores>(s, visible, m[r], l[r]);
          }
          accumulate_values(acc.data() + row0 * NVEC, values, scores.data(), padded, rescale.data(),
                            static_cast<int>(group), visible);
        }
      };
      if constexpr (std::is_same_v<T, float>) {
        attend_head(block_rows<NVEC>(kb, token_stride, n, nullptr), block_rows<NVEC>(vb, token_stride, n, nullptr));
      } else {
        // bfloat16: keys in place for bf16 scores; otherwise keys and values widened once into
        // buffers when enough rows use them, else at each use.
        const Rows<uint16_t, NVEC> k_in_place{kb, token_stride}, v_in_place{vb, token_stride};
        if (in_place_values)
          attend_head(k_in_place, v_in_place);
        else if constexpr (kBf16Scores<T>)
          attend_head(k_in_place, block_rows<NVEC>(vb, token_stride, n, vbuf.data()));
        else
          attend_head(block_rows<NVEC>(kb, token_stride, n, kbuf.data()),
                      block_rows<NVEC>(vb, token_stride, n, vbuf.data()));
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = out + ((first_token + r / heads) * num_heads + head0 + r % heads) * head_dim;
    // l >= 1 for a row that sees any key; a row of an empty sequence (seq_len 0, as padding rows
    // of a fixed-size batch are) sees none and gets zeros.
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int j = 0; j < NVEC; ++j)
      for (int i = 0; i < kLanes; ++i) from_float(acc[r * NVEC + j][i] * inv, dst + j * kLanes + i);
  }
}

// Work items per thread below which a tile's KV heads are split among several items (so that one
// sequence's decode, one tile, still employs every thread).
constexpr int64_t kItemsPerThread = 2;

// Cuts every sequence's new tokens into tiles, and when there are fewer than kItemsPerThread tiles a
// thread, each tile's KV heads into as many ranges as make up the difference; attends the items, shared
// among the threads. A row's arithmetic is the same whichever item holds it.
template <typename T, int NVEC>
void attend_all(const T* q, int64_t q_stride, const T* cache, T* out, const int64_t* block_tables,
                int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs,
                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t num_blocks, float scale,
                int num_threads) {
  struct Item {
    int64_t seq, begin, end, kv_begin, kv_end;  // new tokens [begin, end) of sequence seq, KV heads [kv_begin, kv_end)
  };
  int64_t num_tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    num_tiles += (query_start[s + 1] - query_start[s] + kTileTokens - 1) / kTileTokens;
  const int64_t wanted = kItemsPerThread * num_threads;
  const int64_t parts = num_threads == 1 || num_tiles == 0
                            ? 1
                            : std::clamp<int64_t>((wanted + num_tiles - 1) / num_tiles, 1, num_kv_heads);
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(num_tiles * parts));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s];
    for (int64_t begin = 0; begin < q_len; begin += kTileTokens)
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({s, begin, std::min(q_len, begin + kTileTokens), p * num_kv_heads / parts,
                         (p + 1) * num_kv_heads / parts});
  }
  // Handed out last first: a sequence's later tiles see more blocks, and the runner puts prefill
  // chunks after the decodes, so the costliest items go first and the threads finish together.
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
  for (int64_t i = num_items - 1; i >= 0; --i) {
    const Item& t = items[i];
    attend_tile<T, NVEC>(q, q_stride, cache, out, block_tables + t.seq * table_stride, seq_lens[t.seq],
                         query_start[t.seq], query_start[t.seq + 1] - query_start[t.seq], t.begin, t.end,
                         t.kv_begin, t.kv_end, num_heads, num_kv_heads, block_size, num_blocks, scale);
  }
}

// Dispatches on the head size; returns false for one not compiled in.
template <typename T>
bool paged_attention(const T* q, int64_t q_stride, const T* cache, T* out, const int64_t* block_tables,
                     int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t num_blocks, float scale, int num_threads) {
  switch (head_dim) {
#define NANOSERVE_HEAD_DIM(D)                                                                                   \
  case D:                                                                                                       \
    attend_all<T, D / kLanes>(q, q_stride, cache, out, block_tables, table_stride, seq_lens, query_start, num_seqs, \
                              num_heads, num_kv_heads, block_size, num_blocks, scale, num_threads);              \
    return true;
    NANOSERVE_HEAD_DIM(32)
    NANOSERVE_HEAD_DIM(64)
    NANOSERVE_HEAD_DIM(128)
    NANOSERVE_HEAD_DIM(256)
#undef NANOSERVE_HEAD_DIM
    default:
      return false;
  }
}

template <typename T>
int write_kv(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* cache, const int64_t* slot_mapping,
             int64_t num_tokens, int64_t token_elems, int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t)  // checked first, so a bad slot writes nothing
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return 0;
  T* v_plane = cache + num_slots * token_elems;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    std::memcpy(cache + slot * token_elems, k + t * k_stride, token_elems * sizeof(T));
    std::memcpy(v_plane + slot * token_elems, v + t * v_stride, token_elems * sizeof(T));
  }
  return 1;
}

}  // namespace

extern "C" {

// The entry points return 1 when they ran, 0 for a head size not compiled in (32, 64, 128, 256;
// the caller checks first).
int nanoserve_paged_attention_f32(const float* q, int64_t q_stride, const float* cache, float* out,
                                   const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                   const int64_t* query_start, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                   float scale, int num_threads) {
  return paged_attention(q, q_stride, cache, out, block_tables, table_stride, seq_lens, query_start, num_seqs,
                         num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, num_threads);
}

int nanoserve_paged_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, uint16_t* out,
                                    const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                    const int64_t* query_start, int64_t num_seqs, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                    float scale, int num_threads) {
  return paged_attention(q, q_stride, cache, out, block_tables, table_stride, seq_lens, query_start, num_seqs,
                         num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, num_threads);
}

// Stores K and V rows [num_tokens, token_elems] (rows k_stride / v_stride elements apart) at
// slot_mapping's slots of a layer's cache [2, num_slots, token_elems]. Returns 1, or 0 (and writes
// nothing) when a slot is out of range.
int nanoserve_write_kv_f32(const float* k, int64_t k_stride, const float* v, int64_t v_stride, float* cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems, int64_t num_slots) {
  return write_kv(k, k_stride, v, v_stride, cache, slot_mapping, num_tokens, token_elems, num_slots);
}
int nanoserve_write_kv_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                            uint16_t* cache, const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems,
                            int64_t num_slots) {
  return write_kv(k, k_stride, v, v_stride, cache, slot_mapping, num_tokens, token_elems, num_slots);
}

}  // extern "C"
