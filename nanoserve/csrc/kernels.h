// The library's entry points, every one, as nanoserve/native.py loads them with ctypes (its
// SIGNATURES table mirrors these declarations, and a test checks that it covers all of them). Each
// source includes this header, so a definition that drifts from its declaration fails to compile;
// decoder.cpp composes the others. bfloat16 travels as its raw 16 bits (uint16_t).

#pragma once

#include <cstdint>

extern "C" {

// One matrix W [rows, in] for decoder.cpp: up to three parts stacked by rows (a fused q/k/v or
// gate/up whose parts a checkpoint stores in different formats), each dense [rows, in] row-major in
// the model's element type (qtype -1) or GGUF blocks [rows, row_bytes] of type qtype (quant.cpp).
struct MatrixPart {
  const void* data;
  int64_t rows;
  int64_t qtype;
};
struct Matrix {
  MatrixPart parts[3];
  int64_t num_parts;  // 1 to 3
};

// One decoder layer's parameters for decoder.cpp (null: absent from this family), as
// native_decoder.py fills them (nanoserve.native.LayerWeights mirrors it): vectors in the model's
// element type, matrices as above.
struct LayerWeights {
  const void* input_norm;  // [hidden]
  Matrix qkv;              // [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
  const void* qkv_bias;    // [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2) or null
  const void* q_norm;      // [head_dim] (Qwen3) or null; null exactly when k_norm is
  const void* k_norm;      // [head_dim] or null
  Matrix o_proj;           // [hidden, num_heads * head_dim]
  const void* post_norm;   // [hidden]
  Matrix gate_up;          // [2 * intermediate, hidden]: gate rows, then up rows
  Matrix down;             // [hidden, intermediate]
  int64_t rotary;          // 0: no rotary in this layer (SmolLM3's NoPE layers), and q_norm, k_norm null
};

// layer_ops.cpp
void nanoserve_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t rows, int64_t dim,
                            float eps, int num_threads);
void nanoserve_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w, uint16_t* out, int64_t rows,
                             int64_t dim, float eps, int num_threads);
void nanoserve_qk_norm_rope_f32(float* qkv, int64_t rows, int64_t row_stride, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
                                const float* q_weight, const float* k_weight, float eps, int num_threads);
void nanoserve_qk_norm_rope_bf16(uint16_t* qkv, int64_t rows, int64_t row_stride, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, const uint16_t* cos, const uint16_t* sin,
                                 const uint16_t* q_weight, const uint16_t* k_weight, float eps, int num_threads);
void nanoserve_silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t inter, int num_threads);
void nanoserve_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter, int num_threads);

// linear.cpp
void nanoserve_linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N,
                          int64_t K, int num_threads);
void nanoserve_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                           int64_t N, int64_t K, int num_threads);
void nanoserve_linear_bf16_out_f32(const uint16_t* x, const uint16_t* w, const uint16_t* bias, float* out, int64_t M,
                                   int64_t N, int64_t K, int num_threads);
int nanoserve_linear_bf16_native();

// quant.cpp (qtype: GGUF's tensor type id; weights the raw blocks, [N, row_bytes])
int nanoserve_quant_linear_f32(const float* x, const uint8_t* w, int qtype, const float* bias, float* out,
                               int64_t out_stride, int64_t M, int64_t N, int64_t K, int num_threads);
int nanoserve_quant_linear_bf16(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* bias, uint16_t* out,
                                int64_t out_stride, int64_t M, int64_t N, int64_t K, int num_threads);
int nanoserve_quant_linear_bf16_out_f32(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* bias,
                                        float* out, int64_t out_stride, int64_t M, int64_t N, int64_t K,
                                        int num_threads);
int nanoserve_dequantize_rows_f32(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows,
                                  int64_t n, float* out, int num_threads);
int nanoserve_dequantize_rows_bf16(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows,
                                   int64_t n, uint16_t* out, int num_threads);
int nanoserve_quant_isa();
int nanoserve_quant_amx();

// moe.cpp (experts stacked by rows as GGUF stores them: gate, up [E * I, row_bytes(H)], down
// [E * H, row_bytes(I)]; ids [T, k] in [0, E), weights [T, k])
int nanoserve_moe_ffn_f32(const float* x, const uint8_t* gate, int gate_qtype, const uint8_t* up, int up_qtype,
                          const uint8_t* down, int down_qtype, const int64_t* ids, const float* weights, float* out,
                          int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int num_threads);
int nanoserve_moe_ffn_bf16(const uint16_t* x, const uint8_t* gate, int gate_qtype, const uint8_t* up, int up_qtype,
                           const uint8_t* down, int down_qtype, const int64_t* ids, const float* weights,
                           uint16_t* out, int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int num_threads);

// paged_attention.cpp
int nanoserve_paged_attention_f32(const float* q, int64_t q_stride, const float* cache, float* out,
                                  const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                  const int64_t* query_start, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                  float scale, int num_threads);
int nanoserve_paged_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, uint16_t* out,
                                   const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                   const int64_t* query_start, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                                   float scale, int num_threads);
int nanoserve_write_kv_f32(const float* k, int64_t k_stride, const float* v, int64_t v_stride, float* cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems, int64_t num_slots);
int nanoserve_write_kv_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* v, int64_t v_stride,
                            uint16_t* cache, const int64_t* slot_mapping, int64_t num_tokens, int64_t token_elems,
                            int64_t num_slots);

// decoder.cpp
int nanoserve_decoder_forward_f32(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                  const Matrix* embed, const float* final_norm, const float* cos_table,
                                  const float* sin_table, int64_t table_len, float* kv_cache, int64_t num_blocks,
                                  int64_t block_size, const int64_t* ids, const int64_t* positions, int64_t n,
                                  const int64_t* slot_mapping, const int64_t* block_tables, int64_t table_stride,
                                  const int64_t* seq_lens, const int64_t* query_start, int64_t num_seqs, float* out,
                                  int num_threads);
int nanoserve_decoder_forward_bf16(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                   const Matrix* embed, const uint16_t* final_norm, const uint16_t* cos_table,
                                   const uint16_t* sin_table, int64_t table_len, uint16_t* kv_cache,
                                   int64_t num_blocks, int64_t block_size, const int64_t* ids,
                                   const int64_t* positions, int64_t n, const int64_t* slot_mapping,
                                   const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                   const int64_t* query_start, int64_t num_seqs, uint16_t* out, int num_threads);
int nanoserve_draft_greedy_f32(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                               const Matrix* embed, const float* final_norm, const Matrix* lm_head, int64_t vocab,
                               const float* cos_table, const float* sin_table, int64_t table_len, float* kv_cache,
                               int64_t num_blocks, int64_t block_size, const int64_t* ids, const int64_t* positions,
                               int64_t n, const int64_t* slot_mapping, const int64_t* block_tables,
                               int64_t table_stride, const int64_t* seq_lens, const int64_t* query_start,
                               int64_t num_seqs, const int64_t* budgets, int64_t max_budget, float min_confidence,
                               int64_t* drafts, int64_t* num_drafts, int num_threads);
int nanoserve_draft_greedy_bf16(const int64_t* dims, float eps, float scale, const LayerWeights* layers,
                                const Matrix* embed, const uint16_t* final_norm, const Matrix* lm_head,
                                int64_t vocab, const uint16_t* cos_table, const uint16_t* sin_table, int64_t table_len,
                                uint16_t* kv_cache, int64_t num_blocks, int64_t block_size, const int64_t* ids,
                                const int64_t* positions, int64_t n, const int64_t* slot_mapping,
                                const int64_t* block_tables, int64_t table_stride, const int64_t* seq_lens,
                                const int64_t* query_start, int64_t num_seqs, const int64_t* budgets,
                                int64_t max_budget, float min_confidence, int64_t* drafts, int64_t* num_drafts,
                                int num_threads);

}  // extern "C"
