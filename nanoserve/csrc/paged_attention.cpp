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
// all in fp32. A bf16 cache's scores come, where the build has AVX512-BF16, from vdpbf16ps on the
// stored bf16 query and keys (the scale applied to each sum), elsewhere from fp32 FMAs on widened
// values; its values are widened to fp32 (once per block into a buffer when kWidenRows rows or more
// use them, else at each use: the same floats), and only the result is rounded to bf16. A row's
// arithmetic does not depend on how its sequence was tiled or its heads split. The running maxima
// start at a finite sentinel, so no infinity enters the arithmetic.
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

// s[t] = scale * (q . k[t]) for t < n, the query q and each key read as stored, in vectors of 32
// bfloat16 values (NVEC / 4 a head); four keys at a time, four independent chains.
template <int NVEC>
inline void dot_keys(const uint16_t* q, const Rows<uint16_t, NVEC>& k, int n, float scale, float* s) {
  constexpr int QN = NVEC / 4;
  const auto bf16x32 = [](const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); };
  const auto key = [&](int t, int j) { return bf16x32(k.base + t * k.stride + j * 32); };
  int t = 0;
  for (; t + 4 <= n; t += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int j = 0; j < QN; ++j) {
      const __m512bh qj = bf16x32(q + j * 32);
      a0 = _mm512_dpbf16_ps(a0, qj, key(t, j));
      a1 = _mm512_dpbf16_ps(a1, qj, key(t + 1, j));
      a2 = _mm512_dpbf16_ps(a2, qj, key(t + 2, j));
      a3 = _mm512_dpbf16_ps(a3, qj, key(t + 3, j));
    }
    s[t] = _mm512_reduce_add_ps(a0) * scale, s[t + 1] = _mm512_reduce_add_ps(a1) * scale;
    s[t + 2] = _mm512_reduce_add_ps(a2) * scale, s[t + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; t < n; ++t) {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < QN; ++j) a = _mm512_dpbf16_ps(a, bf16x32(q + j * 32), key(t, j));
    s[t] = _mm512_reduce_add_ps(a) * scale;
  }
}
#else
template <typename T>
constexpr bool kBf16Scores = false;
#endif

// acc = acc * rescale + sum_t p[t] v[t] for t < n, each value's operations the same on every path
// (the product by rescale, then one FMA per t in order): with AVX-512 in vectors of 16 floats, eight
// of the row at a time kept in registers across the block's values (half the instructions of the
// vectors of eight, the same arithmetic); else eight vectors of eight at a time.
template <typename E, int NVEC>
inline void accumulate_values(vec8* acc, const Rows<E, NVEC>& v, const float* p, float rescale, int n) {
#if defined(__AVX512F__)
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
  float* out = reinterpret_cast<float*>(acc);
  for (int j = 0; j < kWide; j += kChunk) {
    __m512 c[kChunk];
    for (int i = 0; i < kChunk; ++i) c[i] = _mm512_mul_ps(_mm512_loadu_ps(out + (j + i) * 16), _mm512_set1_ps(rescale));
    for (int t = 0; t < n; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      for (int i = 0; i < kChunk; ++i) c[i] = _mm512_fmadd_ps(pt, at(t, j + i), c[i]);
    }
    for (int i = 0; i < kChunk; ++i) _mm512_storeu_ps(out + (j + i) * 16, c[i]);
  }
#else
  constexpr int kChunk = NVEC < 8 ? NVEC : 8;
  static_assert(NVEC % kChunk == 0, "head sizes are 32 or multiples of 64");
  for (int j = 0; j < NVEC; j += kChunk) {
    vec8 c[kChunk];
    for (int i = 0; i < kChunk; ++i) c[i] = acc[j + i] * rescale;
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < kChunk; ++i) c[i] += p[t] * v.at(t, j + i);
    for (int i = 0; i < kChunk; ++i) acc[j + i] = c[i];
  }
#endif
}

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
  std::vector<float> m(rows, kMasked), l(rows, 0.0f), scores((block_size + kLanes - 1) / kLanes * kLanes);
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
      // The tile's rows of KV head h against its keys and values in this block.
      const auto attend_head = [&](const auto& keys, const auto& values) {
        for (int64_t tok = 0; tok < tile_len; ++tok) {
          const int visible =
              static_cast<int>(std::clamp<int64_t>(first_limit + tok_begin + tok - first + 1, 0, n));
          if (visible == 0) continue;
          const int64_t row0 = tok * heads + (h - kv_begin) * group;
          for (int64_t r = row0; r < row0 + group; ++r) {
            float* s = scores.data();
            if constexpr (kBf16Scores<T>)
              dot_keys(qb.data() + r * head_dim, keys, visible, scale, s);
            else
              dot_keys(qv.data() + r * NVEC, keys, visible, s);
            float m_new = m[r];
            for (int t = 0; t < visible; ++t) m_new = std::max(m_new, s[t]);
            const float rescale = exp_nonpositive(vec8{} + (m[r] - m_new))[0];
            vec8 sum = {};
            for (int t = 0; t < visible; t += kLanes) {  // `scores` has room for whole vectors
              vec8 e;
              std::memcpy(&e, s + t, sizeof e);
              e = exp_nonpositive(e - m_new);
              for (int i = visible - t; i < kLanes; ++i) e[i] = 0.0f;  // past the visible keys
              std::memcpy(s + t, &e, sizeof e);
              sum += e;
            }
            l[r] = l[r] * rescale + hsum(sum);
            m[r] = m_new;
            accumulate_values(acc.data() + r * NVEC, values, s, rescale, visible);
          }
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
