// Paged attention on the CPU, straight from the block pool: decodes, drafts and prefill chunks alike.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there).
//
// Query token i of a sequence with q_len new tokens and seq_len tokens in all sees the keys at
// positions <= seq_len - q_len + i (causal among the new tokens). A sequence's new tokens are cut
// into tiles of at most kTileTokens consecutive tokens (a decode, or a query of up to kTileTokens
// tokens, is one tile), and the tiles of all sequences are the work items, shared among
// `num_threads` OpenMP threads; each writes only its own rows of out. A tile's query rows (each of
// its tokens times each query head) are attended in one pass over the blocks that its last token
// can see: each block's keys and values are read once per tile, for each KV head serving all the
// query heads that share it (GQA) and all the tile's tokens, while the tile's queries and
// accumulators stay in L1/L2. Softmax is online (flash-decoding): per block and row, the scores,
// one rescale of the accumulator, then the weighted sum of the block's values, all in fp32 (bf16 K
// and V are widened, and only the result is rounded to bf16). A row's arithmetic does not depend
// on how its sequence was tiled. The running maxima start at a finite sentinel, so no infinity
// enters the arithmetic.
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

#include "kernels.h"
#include "simd.h"

namespace {

using namespace nanoserve;

constexpr float kMasked = -1e30f;  // the running maximum before any key

// A block's keys (or values) for one KV head, as rows of NVEC vectors of float: read in place
// for a float cache, widened into `buf` for bfloat16. Row t starts at base + t * stride floats.
template <int NVEC>
struct Rows {
  const float* base;
  int64_t stride;
  vec8 at(int t, int j) const { return *reinterpret_cast<const uvec8*>(base + t * stride + j * kLanes); }
};

template <int NVEC>
Rows<NVEC> block_rows(const float* src, int64_t token_stride, int /*n*/, vec8* /*buf*/) {
  return {src, token_stride};
}

template <int NVEC>
Rows<NVEC> block_rows(const uint16_t* src, int64_t token_stride, int n, vec8* buf) {
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < NVEC; ++j) buf[t * NVEC + j] = load8(src + t * token_stride + j * kLanes);
  return {reinterpret_cast<const float*>(buf), NVEC * kLanes};
}

// s[t] = q . k[t] for t < n: four keys at a time, so four independent FMA chains are in flight.
template <int NVEC>
inline void dot_keys(const vec8* q, const Rows<NVEC>& k, int n, float* s) {
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

// acc = acc * rescale + sum_t p[t] v[t] for t < n, eight vectors of the row at a time kept in
// registers across the block's values (eight independent FMA chains).
template <int NVEC>
inline void accumulate_values(vec8* acc, const Rows<NVEC>& v, const float* p, float rescale, int n) {
  constexpr int kChunk = NVEC < 8 ? NVEC : 8;
  static_assert(NVEC % kChunk == 0, "head sizes are 32 or multiples of 64");
  for (int j = 0; j < NVEC; j += kChunk) {
    vec8 c[kChunk];
    for (int i = 0; i < kChunk; ++i) c[i] = acc[j + i] * rescale;
    for (int t = 0; t < n; ++t)
      for (int i = 0; i < kChunk; ++i) c[i] += p[t] * v.at(t, j + i);
    for (int i = 0; i < kChunk; ++i) acc[j + i] = c[i];
  }
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

// New tokens per tile (work item). 16 tokens of 4 query heads of 64 keep a tile's queries and
// accumulators at 32 KiB; a query of at most this many tokens (a decode, a decode carrying up to 15
// drafts, a short prefill chunk) is one tile and reads its sequence's K and V once.
constexpr int64_t kTileTokens = 16;

// Attends the query rows of new tokens [tok_begin, tok_end) of one sequence: row r is new token
// tok_begin + r / num_heads and query head r % num_heads, reading KV head (r % num_heads) / group.
// The blocks up to the one holding the last key that token tok_end - 1 sees are walked once, each
// one's K and V for all heads read as two contiguous runs, and the next block is prefetched
// meanwhile (block tables scatter blocks, which hardware prefetchers cannot follow).
template <typename T, int NVEC>
void attend_tile(const T* q, int64_t q_stride, const T* cache, T* out, const int64_t* table, int64_t seq_len,
                 int64_t q_start, int64_t q_len, int64_t tok_begin, int64_t tok_end, int64_t num_heads,
                 int64_t num_kv_heads, int64_t block_size, int64_t num_blocks, float scale) {
  constexpr int64_t head_dim = NVEC * kLanes;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tile_len = tok_end - tok_begin;
  const int rows = static_cast<int>(tile_len * num_heads);
  const int64_t v_plane = num_blocks * block_size * num_kv_heads * head_dim;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_elems = block_size * token_stride;

  std::vector<vec8> qv(static_cast<size_t>(rows) * NVEC), acc(qv.size());
  std::vector<float> m(rows, kMasked), l(rows, 0.0f), scores((block_size + kLanes - 1) / kLanes * kLanes);
  std::vector<vec8> kbuf(std::is_same_v<T, float> ? 0 : block_size * NVEC), vbuf(kbuf.size());
  const int64_t first_token = q_start + tok_begin;  // the tile's first row of q and of out
  for (int r = 0; r < rows; ++r)  // token-major, then head, as out is laid out
    load_query(q + (first_token + r / num_heads) * q_stride + (r % num_heads) * head_dim, scale,
               qv.data() + r * NVEC, NVEC);

  const int64_t first_limit = seq_len - q_len;  // the last key that new token 0 may see
  // Through the block of the last key the tile's last token sees; none for an empty sequence.
  const int64_t nblk = seq_len == 0 ? 0 : (first_limit + tok_end - 1) / block_size + 1;
  for (int64_t b = 0; b < nblk; ++b) {
    if (b + 1 < nblk) {
      const char* next_k = reinterpret_cast<const char*>(cache + table[b + 1] * block_elems);
      const char* next_v = reinterpret_cast<const char*>(cache + v_plane + table[b + 1] * block_elems);
      for (size_t off = 0; off < block_elems * sizeof(T); off += 64) {
        __builtin_prefetch(next_k + off);
        __builtin_prefetch(next_v + off);
      }
    }
    const int64_t first = b * block_size;
    const int n = static_cast<int>(std::min<int64_t>(block_size, seq_len - first));
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const T* kb = cache + table[b] * block_elems + h * head_dim;
      const Rows<NVEC> keys = block_rows<NVEC>(kb, token_stride, n, kbuf.data());
      const Rows<NVEC> values = block_rows<NVEC>(kb + v_plane, token_stride, n, vbuf.data());
      for (int64_t tok = 0; tok < tile_len; ++tok) {
        const int visible =
            static_cast<int>(std::clamp<int64_t>(first_limit + tok_begin + tok - first + 1, 0, n));
        if (visible == 0) continue;
        for (int64_t r = tok * num_heads + h * group; r < tok * num_heads + (h + 1) * group; ++r) {
          float* s = scores.data();
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
    }
  }

  for (int r = 0; r < rows; ++r) {
    T* dst = out + (first_token * num_heads + r) * head_dim;
    // l >= 1 for a row that sees any key; a row of an empty sequence (seq_len 0, as padding rows
    // of a fixed-size batch are) sees none and gets zeros.
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int j = 0; j < NVEC; ++j)
      for (int i = 0; i < kLanes; ++i) from_float(acc[r * NVEC + j][i] * inv, dst + j * kLanes + i);
  }
}

// Cuts every sequence's new tokens into tiles and attends them, the tiles shared among the threads.
template <typename T, int NVEC>
void attend_all(const T* q, int64_t q_stride, const T* cache, T* out, const int64_t* block_tables,
                int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs,
                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t num_blocks, float scale,
                int num_threads) {
  struct Tile {
    int64_t seq, begin, end;  // new tokens [begin, end) of sequence seq
  };
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = query_start[s + 1] - query_start[s];
    for (int64_t begin = 0; begin < q_len; begin += kTileTokens)
      tiles.push_back({s, begin, std::min(q_len, begin + kTileTokens)});
  }
  // Handed out last first: a sequence's later tiles see more blocks, and the runner puts prefill
  // chunks after the decodes, so the costliest items go first and the threads finish together.
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_threads > 1)
  for (int64_t i = num_tiles - 1; i >= 0; --i) {
    const Tile& t = tiles[i];
    attend_tile<T, NVEC>(q, q_stride, cache, out, block_tables + t.seq * table_stride, seq_lens[t.seq],
                         query_start[t.seq], query_start[t.seq + 1] - query_start[t.seq], t.begin, t.end, num_heads,
                         num_kv_heads, block_size, num_blocks, scale);
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
