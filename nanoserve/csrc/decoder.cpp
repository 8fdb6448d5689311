// A whole decoder forward on the CPU in one call: embedding, every layer, final norm.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there). It makes
// the library calls that nanoserve.model.decoder.CausalLM.forward makes through CpuLayerOps and
// CpuPagedAttention, in the same order, with the same arguments and thread count, so its output is
// bit for bit theirs; what it saves is the Python between them: ~13 calls per layer, each with its
// interpreter, argument conversion and tensor allocation, which for a small model or a single
// sequence cost as much as the arithmetic. Every product goes to linear.cpp or quant.cpp, for any
// number of tokens, so steps of every size come here (see nanoserve/model/native_decoder.py).
//
// Per layer, on the flat batch of n new tokens (hidden rows of the residual stream):
//   normed = RMSNorm(residual += x)          x: the previous layer's MLP output (zeros at layer 0)
//   qkv = normed Wqkv^T (+ b); q, k normed per head (Qwen3) and rotated in place
//   K, V -> the layer's cache at the tokens' slots; attn = paged attention of q
//   normed = RMSNorm(residual += attn Wo^T)
//   x = (silu(gate) * up)(normed Wgu^T) Wdown^T
// and at the end out = RMSNorm(residual += x).
//
// Layouts: as CausalLM holds them (each matrix dense [out, in] row-major or GGUF blocks, in up to
// three parts stacked by rows: Matrix and LayerWeights in kernels.h; a quantized embedding table's
// rows are dequantized as they are gathered);
// the cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; cos and sin tables
// [table_len, head_dim] (row p: position p); block_tables [num_seqs, table_stride]; out [n, hidden].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "kernels.h"
#include "simd.h"

namespace {

// The entry points by element type.
inline void rms_norm(const float* x, float* r, const float* w, float* o, int64_t rows, int64_t dim, float eps, int t) {
  nanoserve_rms_norm_f32(x, r, w, o, rows, dim, eps, t);
}
inline void rms_norm(const uint16_t* x, uint16_t* r, const uint16_t* w, uint16_t* o, int64_t rows, int64_t dim,
                     float eps, int t) {
  nanoserve_rms_norm_bf16(x, r, w, o, rows, dim, eps, t);
}
inline void qk_norm_rope(float* qkv, int64_t rows, int64_t stride, int64_t h, int64_t kvh, int64_t d, const float* cos,
                         const float* sin, const float* qw, const float* kw, float eps, int t) {
  nanoserve_qk_norm_rope_f32(qkv, rows, stride, h, kvh, d, cos, sin, qw, kw, eps, t);
}
inline void qk_norm_rope(uint16_t* qkv, int64_t rows, int64_t stride, int64_t h, int64_t kvh, int64_t d,
                         const uint16_t* cos, const uint16_t* sin, const uint16_t* qw, const uint16_t* kw, float eps,
                         int t) {
  nanoserve_qk_norm_rope_bf16(qkv, rows, stride, h, kvh, d, cos, sin, qw, kw, eps, t);
}
inline void silu_mul(const float* gu, float* o, int64_t rows, int64_t inter, int t) {
  nanoserve_silu_mul_f32(gu, o, rows, inter, t);
}
inline void silu_mul(const uint16_t* gu, uint16_t* o, int64_t rows, int64_t inter, int t) {
  nanoserve_silu_mul_bf16(gu, o, rows, inter, t);
}
inline void linear(const float* x, const float* w, const float* b, float* o, int64_t M, int64_t N, int64_t K, int t) {
  nanoserve_linear_f32(x, w, b, o, M, N, K, t);
}
inline void linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* o, int64_t M, int64_t N,
                   int64_t K, int t) {
  nanoserve_linear_bf16(x, w, b, o, M, N, K, t);
}
inline void linear(const uint16_t* x, const uint16_t* w, const uint16_t* b, float* o, int64_t M, int64_t N, int64_t K,
                   int t) {
  nanoserve_linear_bf16_out_f32(x, w, b, o, M, N, K, t);
}
inline void quant_linear(const float* x, const uint8_t* w, int qtype, const float* b, float* o, int64_t stride,
                         int64_t M, int64_t N, int64_t K, int t) {
  nanoserve_quant_linear_f32(x, w, qtype, b, o, stride, M, N, K, t);
}
inline void quant_linear(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* b, uint16_t* o,
                         int64_t stride, int64_t M, int64_t N, int64_t K, int t) {
  nanoserve_quant_linear_bf16(x, w, qtype, b, o, stride, M, N, K, t);
}
inline void quant_linear(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* b, float* o, int64_t stride,
                         int64_t M, int64_t N, int64_t K, int t) {
  nanoserve_quant_linear_bf16_out_f32(x, w, qtype, b, o, stride, M, N, K, t);
}
inline void dequantize_rows(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows, int64_t n,
                            float* o, int t) {
  nanoserve_dequantize_rows_f32(w, qtype, num_rows, K, rows, n, o, t);
}
inline void dequantize_rows(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows, int64_t n,
                            uint16_t* o, int t) {
  nanoserve_dequantize_rows_bf16(w, qtype, num_rows, K, rows, n, o, t);
}
inline int write_kv(const float* k, int64_t ks, const float* v, int64_t vs, float* cache, const int64_t* slots,
                    int64_t n, int64_t elems, int64_t num_slots) {
  return nanoserve_write_kv_f32(k, ks, v, vs, cache, slots, n, elems, num_slots);
}
inline int write_kv(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, uint16_t* cache,
                    const int64_t* slots, int64_t n, int64_t elems, int64_t num_slots) {
  return nanoserve_write_kv_bf16(k, ks, v, vs, cache, slots, n, elems, num_slots);
}
inline int paged_attention(const float* q, int64_t qs, const float* cache, float* o, const int64_t* tables,
                           int64_t table_stride, const int64_t* seq_lens, const int64_t* qsl, int64_t num_seqs,
                           int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, float scale, int t) {
  return nanoserve_paged_attention_f32(q, qs, cache, o, tables, table_stride, seq_lens, qsl, num_seqs, h, kvh, d, bs,
                                       nb, scale, t);
}
inline int paged_attention(const uint16_t* q, int64_t qs, const uint16_t* cache, uint16_t* o, const int64_t* tables,
                           int64_t table_stride, const int64_t* seq_lens, const int64_t* qsl, int64_t num_seqs,
                           int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t nb, float scale, int t) {
  return nanoserve_paged_attention_bf16(q, qs, cache, o, tables, table_stride, seq_lens, qsl, num_seqs, h, kvh, d,
                                        bs, nb, scale, t);
}

// out [M, sum of the parts' rows] = x [M, K] w^T (+ bias), as CpuLayerOps.linear computes it (O
// T), or CpuLayerOps.logits (O float): a single dense matrix by linear.cpp; otherwise each part into
// its columns of out (a dense part through a buffer, with its slice of the bias).
template <typename T, typename O>
void product(const T* x, const Matrix& w, const T* bias, O* out, int64_t M, int64_t K, int num_threads) {
  int64_t N = 0;
  for (int64_t p = 0; p < w.num_parts; ++p) N += w.parts[p].rows;
  if (w.num_parts == 1 && w.parts[0].qtype < 0) {
    linear(x, static_cast<const T*>(w.parts[0].data), bias, out, M, N, K, num_threads);
    return;
  }
  for (int64_t p = 0, offset = 0; p < w.num_parts; offset += w.parts[p++].rows) {
    const MatrixPart& part = w.parts[p];
    const T* part_bias = bias != nullptr ? bias + offset : nullptr;
    if (part.qtype >= 0) {
      quant_linear(x, static_cast<const uint8_t*>(part.data), static_cast<int>(part.qtype), part_bias, out + offset,
                   N, M, part.rows, K, num_threads);
      continue;
    }
    std::unique_ptr<O[]> columns(new O[M * part.rows]);
    linear(x, static_cast<const T*>(part.data), part_bias, columns.get(), M, part.rows, K, num_threads);
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(out + m * N + offset, columns.get() + m * part.rows, part.rows * sizeof(O));
  }
}

template <typename T>
int decoder_forward(const int64_t* dims, float eps, float scale, const LayerWeights* layers, const Matrix* embed,
                    const T* final_norm, const T* cos_table, const T* sin_table, int64_t table_len, T* kv_cache,
                    int64_t num_blocks, int64_t block_size, const int64_t* ids, const int64_t* positions, int64_t n,
                    const int64_t* slot_mapping, const int64_t* block_tables, int64_t table_stride,
                    const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs, T* out,
                    int num_threads) {
  const int64_t vocab = dims[0], hidden = dims[1], heads = dims[2], kv_heads = dims[3], d = dims[4],
                inter = dims[5], num_layers = dims[6];
  const int64_t q_size = heads * d, kv_size = kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const int64_t num_slots = num_blocks * block_size, layer_elems = 2 * num_slots * kv_size;
  for (int64_t t = 0; t < n; ++t) {  // everything that indexes memory, checked before anything is written
    if (ids[t] < 0 || ids[t] >= vocab) return -1;
    if (positions[t] < 0 || positions[t] >= table_len) return -2;
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return 0;
  }
  const int64_t sizes[] = {n * hidden, n * hidden, n * hidden, n * qkv_size, n * q_size, n * 2 * inter, n * inter,
                           n * d, n * d};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  std::unique_ptr<T[]> work(new T[total]);
  T* buf[9];
  for (int i = 0, off = 0; i < 9; off += sizes[i++]) buf[i] = work.get() + off;
  T *residual = buf[0], *x = buf[1], *normed = buf[2], *qkv = buf[3], *attn = buf[4], *gate_up = buf[5],
    *act = buf[6], *cos = buf[7], *sin = buf[8];
  const MatrixPart& table = embed->parts[0];
  if (table.qtype >= 0)
    dequantize_rows(static_cast<const uint8_t*>(table.data), static_cast<int>(table.qtype), vocab, hidden, ids, n,
                    residual, num_threads);
  for (int64_t t = 0; t < n; ++t) {
    if (table.qtype < 0)
      std::memcpy(residual + t * hidden, static_cast<const T*>(table.data) + ids[t] * hidden, hidden * sizeof(T));
    std::memcpy(cos + t * d, cos_table + positions[t] * d, d * sizeof(T));
    std::memcpy(sin + t * d, sin_table + positions[t] * d, d * sizeof(T));
  }
  std::memset(x, 0, n * hidden * sizeof(T));  // what layer 0 adds into the stream, as CausalLM.forward does
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerWeights& w = layers[i];
    T* cache = kv_cache + i * layer_elems;
    rms_norm(x, residual, static_cast<const T*>(w.input_norm), normed, n, hidden, eps, num_threads);
    product(normed, w.qkv, static_cast<const T*>(w.qkv_bias), qkv, n, hidden, num_threads);
    if (w.rotary)
      qk_norm_rope(qkv, n, qkv_size, heads, kv_heads, d, cos, sin, static_cast<const T*>(w.q_norm),
                   static_cast<const T*>(w.k_norm), eps, num_threads);
    write_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, cache, slot_mapping, n, kv_size, num_slots);
    paged_attention(qkv, qkv_size, cache, attn, block_tables, table_stride, seq_lens, query_start, num_seqs, heads,
                    kv_heads, d, block_size, num_blocks, scale, num_threads);
    product(attn, w.o_proj, static_cast<const T*>(nullptr), x, n, q_size, num_threads);
    rms_norm(x, residual, static_cast<const T*>(w.post_norm), normed, n, hidden, eps, num_threads);
    product(normed, w.gate_up, static_cast<const T*>(nullptr), gate_up, n, hidden, num_threads);
    silu_mul(gate_up, act, n, inter, num_threads);
    product(act, w.down, static_cast<const T*>(nullptr), x, n, inter, num_threads);
  }
  rms_norm(x, residual, final_norm, out, n, hidden, eps, num_threads);
  return 1;
}

// sum_v exp(row[v] - top) for top = max_v row[v]: the softmax's denominator, so 1 / it is the
// probability of the argmax.
template <typename T>
float softmax_denominator(const T* row, int64_t vocab, float top) {
  using namespace nanoserve;
  vec8 acc{};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) acc += exp_nonpositive(load8(row + v) - top);
  float total = hsum(acc);
  for (; v < vocab; ++v) total += std::exp(to_float(row[v]) - top);
  return total;
}

// Greedy drafting for speculative decoding: the first pass over the prepared batch (each sequence's
// tokens not yet computed), then one single-token pass per further draft for the sequences still
// drafting, all in here. After each pass the LM head runs on each sequence's last hidden state (the
// library's product with fp32 outputs, as CausalLM.compute_logits makes it); the draft is the argmax of the first
// `vocab` logits (the tokens the engine samples from: a checkpoint's padding rows are never drafted)
// as floats (the first on ties, as torch's argmax), and a sequence goes on while it has budget left
// and the draft model gave its draft at least `min_confidence` probability (softmax at temperature
// 1). A later pass feeds each sequence its last draft at the position after its last token, into
// the slot its block table holds for that position: the caller must have allocated blocks for every
// position fed (a padding entry of a shorter table is not told apart from block 0). Output: drafts
// [num_seqs, max_budget] and num_drafts [num_seqs] (each at least 1). Returns 1, or what
// decoder_forward refused, or 0 for a position past a sequence's block table.
template <typename T>
int draft_greedy(const int64_t* dims, float eps, float scale, const LayerWeights* layers, const Matrix* embed,
                 const T* final_norm, const Matrix* lm_head, int64_t vocab, const T* cos_table, const T* sin_table,
                 int64_t table_len, T* kv_cache, int64_t num_blocks, int64_t block_size, const int64_t* ids,
                 const int64_t* positions, int64_t n, const int64_t* slot_mapping, const int64_t* block_tables,
                 int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs,
                 const int64_t* budgets, int64_t max_budget, float min_confidence, int64_t* drafts,
                 int64_t* num_drafts, int num_threads) {
  const int64_t rows = dims[0], hidden = dims[1];  // the whole head, as compute_logits multiplies it
  std::unique_ptr<T[]> out(new T[std::max(n, num_seqs) * hidden]), last(new T[num_seqs * hidden]);
  std::unique_ptr<float[]> logits(new float[num_seqs * rows]);
  int rc = decoder_forward(dims, eps, scale, layers, embed, final_norm, cos_table, sin_table, table_len, kv_cache,
                           num_blocks, block_size, ids, positions, n, slot_mapping, block_tables, table_stride,
                           seq_lens, query_start, num_seqs, out.get(), num_threads);
  if (rc != 1) return rc;
  std::unique_ptr<int64_t[]> index(new int64_t[7 * num_seqs + 1]);  // one step's arrays, for the active sequences
  int64_t *active = index.get(), *lens = active + num_seqs, *step_ids = lens + num_seqs,
          *step_pos = step_ids + num_seqs, *step_slots = step_pos + num_seqs, *step_lens = step_slots + num_seqs,
          *step_start = step_lens + num_seqs;  // num_seqs + 1
  std::unique_ptr<int64_t[]> step_tables(new int64_t[num_seqs * table_stride]);
  for (int64_t i = 0; i < num_seqs; ++i) {
    active[i] = i;
    lens[i] = seq_lens[i];
    std::memcpy(last.get() + i * hidden, out.get() + (query_start[i + 1] - 1) * hidden, hidden * sizeof(T));
  }
  for (int64_t m = num_seqs, s = 0; m > 0; ++s) {
    product(last.get(), *lm_head, static_cast<const T*>(nullptr), logits.get(), m, hidden, num_threads);
    int64_t kept = 0;
    for (int64_t j = 0; j < m; ++j) {
      const float* row = logits.get() + j * rows;
      int64_t best = 0;
      float top = nanoserve::to_float(row[0]);
      for (int64_t v = 1; v < vocab; ++v)
        if (nanoserve::to_float(row[v]) > top) top = nanoserve::to_float(row[v]), best = v;
      const int64_t seq = active[j];
      drafts[seq * max_budget + s] = best;
      num_drafts[seq] = s + 1;
      if (s + 1 >= budgets[seq] || (min_confidence > 0.0f && 1.0f / softmax_denominator(row, vocab, top) <
                                                                   min_confidence))
        continue;
      const int64_t pos = lens[seq]++;
      if (pos / block_size >= table_stride) return 0;
      active[kept] = seq;
      step_ids[kept] = best;
      step_pos[kept] = pos;
      step_slots[kept] = block_tables[seq * table_stride + pos / block_size] * block_size + pos % block_size;
      step_lens[kept] = pos + 1;
      step_start[kept] = kept;
      std::memcpy(step_tables.get() + kept * table_stride, block_tables + seq * table_stride,
                  table_stride * sizeof(int64_t));
      ++kept;
    }
    m = kept;
    if (m == 0) break;
    step_start[m] = m;
    rc = decoder_forward(dims, eps, scale, layers, embed, final_norm, cos_table, sin_table, table_len, kv_cache,
                         num_blocks, block_size, step_ids, step_pos, m, step_slots, step_tables.get(), table_stride,
                         step_lens, step_start, m, last.get(), num_threads);
    if (rc != 1) return rc;
  }
  return 1;
}

}  // namespace

extern "C" {

// Writes the final hidden states [n, hidden] of the n new tokens into out. dims: vocab, hidden,
// num_heads, num_kv_heads, head_dim (one paged_attention.cpp is built for), intermediate,
// num_layers. Returns 1; or, having written nothing, -1 for a token id outside the vocabulary, -2
// for a position outside the rotary tables, 0 for a slot outside the cache.
int nanoserve_decoder_forward_f32(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                  const Matrix* embed, const float* final_norm, const float* cos_table,
                                  const float* sin_table, int64_t table_len, float* kv_cache, int64_t num_blocks,
                                  int64_t block_size, const int64_t* ids, const int64_t* positions, int64_t n,
                                  const int64_t* slot_mapping, const int64_t* block_tables, int64_t table_stride,
                                  const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs, float* out,
                                  int num_threads) {
  return decoder_forward(dims, eps, scale, layers, embed, final_norm, cos_table, sin_table, table_len, kv_cache,
                         num_blocks, block_size, ids, positions, n, slot_mapping, block_tables, table_stride, seq_lens,
                         query_start, num_seqs, out, num_threads);
}
int nanoserve_decoder_forward_bf16(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                   const Matrix* embed, const uint16_t* final_norm, const uint16_t* cos_table,
                                   const uint16_t* sin_table, int64_t table_len, uint16_t* kv_cache,
                                   int64_t num_blocks, int64_t block_size, const int64_t* ids,
                                   const int64_t* positions, int64_t n, const int64_t* slot_mapping,
                                   const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                   const int64_t* query_start, int64_t num_seqs, uint16_t* out, int num_threads) {
  return decoder_forward(dims, eps, scale, layers, embed, final_norm, cos_table, sin_table, table_len, kv_cache,
                         num_blocks, block_size, ids, positions, n, slot_mapping, block_tables, table_stride, seq_lens,
                         query_start, num_seqs, out, num_threads);
}

// Greedy drafting (draft_greedy above) from a prepared first pass; lm_head [dims[0] >= vocab, hidden],
// budgets [num_seqs] (each at least 1 and at most max_budget), drafts [num_seqs, max_budget],
// num_drafts [num_seqs].
int nanoserve_draft_greedy_f32(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                               const Matrix* embed, const float* final_norm, const Matrix* lm_head, int64_t vocab,
                               const float* cos_table, const float* sin_table, int64_t table_len, float* kv_cache,
                               int64_t num_blocks, int64_t block_size, const int64_t* ids, const int64_t* positions,
                               int64_t n, const int64_t* slot_mapping, const int64_t* block_tables,
                               int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start,
                               int64_t num_seqs, const int64_t* budgets, int64_t max_budget, float min_confidence,
                               int64_t* drafts, int64_t* num_drafts, int num_threads) {
  return draft_greedy(dims, eps, scale, layers, embed, final_norm, lm_head, vocab, cos_table, sin_table, table_len,
                      kv_cache, num_blocks, block_size, ids, positions, n, slot_mapping, block_tables, table_stride,
                      seq_lens, query_start, num_seqs, budgets, max_budget, min_confidence, drafts, num_drafts,
                      num_threads);
}
int nanoserve_draft_greedy_bf16(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                const Matrix* embed, const uint16_t* final_norm, const Matrix* lm_head,
                                int64_t vocab, const uint16_t* cos_table, const uint16_t* sin_table, int64_t table_len,
                                uint16_t* kv_cache, int64_t num_blocks, int64_t block_size, const int64_t* ids,
                                const int64_t* positions, int64_t n, const int64_t* slot_mapping,
                                const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                const int64_t* query_start, int64_t num_seqs, const int64_t* budgets,
                                int64_t max_budget, float min_confidence, int64_t* drafts, int64_t* num_drafts,
                                int num_threads) {
  return draft_greedy(dims, eps, scale, layers, embed, final_norm, lm_head, vocab, cos_table, sin_table, table_len,
                      kv_cache, num_blocks, block_size, ids, positions, n, slot_mapping, block_tables, table_stride,
                      seq_lens, query_start, num_seqs, budgets, max_budget, min_confidence, drafts, num_drafts,
                      num_threads);
}

}  // extern "C"
