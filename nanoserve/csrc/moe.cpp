// The routed feed-forward of a mixture-of-experts layer in one call: for T tokens, each sent to k
// of E experts with a weight,
//   out[t] = sum_{j < k} weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j],
// with every expert's gate, up and down in a GGUF block format (quant_blocks.h's list; the three
// may differ), kept quantized: the entry points that kernels.h declares for it.
//
// The experts are stacked by rows as GGUF stores them (ffn_gate_exps [E, I, H] is E * I rows of H
// values): gate and up [E * I, row_bytes(H)], expert e's rows e * I .. (e + 1) * I; down
// [E * H, row_bytes(I)], expert e's rows e * H .. (e + 1) * H.
//
// Structure (as llama.cpp's mul_mat_id: tokens grouped by expert, each chosen expert's weights
// streamed once per call for all its tokens; experts no token chose are never read):
//   1. routing: the (token, slot) pairs grouped by expert (a counting sort; within an expert, token
//      order), and x quantized once for the gate and up products (quant_dot.h's Activations),
//      then each chosen expert's rows of it gathered (a copy of the quantized rows);
//   2. gate and up: quant_dot.h's column_range over 64 output columns at a time into fp32
//      [pairs, 2 I] (gate columns, then up);
//   3. per expert: silu(gate) * up in fp32 (layer_ops.cpp's silu_mul), quantized for down;
//   4. down: column_range over 64 output columns at a time into fp32 [pairs, H];
//   5. per token: the weighted sum of its k rows in slot order j = 0 .. k - 1, rounded to T once.
// Work sharing among the OpenMP threads: with at least two chosen experts per thread (a decode
// step: one token, k = 8 experts) each work item is one whole expert, steps 1-4, so the threads
// meet once, before step 5 (each meeting costs a wake-up on a busy machine); with fewer, each
// step's items are (expert, 64 columns), shared out step by step, so every thread streams weights
// even when one or two experts hold all the work. Without AVX2 each row of W is dequantized and
// multiplied with the fp32 rows (no activation quantization), as quant.cpp's scalar path.
//
// Batch invariance: each pair's gate, up and down outputs depend on its token's row and the
// expert's rows only (column_range's invariant: not on how many rows share the product or their
// place), the quantization of a row on that row only, and the sum over slots has a fixed order; so
// each token's output is the same bits whatever other tokens share the call and whichever experts
// they chose.
//
// This file includes quant.cpp's private headers as a second translation unit: everything in them
// has internal linkage, so each file gets its own copy, compiled and inlined for it.
//
// Invariants: an entry point writes nothing to out unless it returns 1 (types and widths it takes,
// expert ids in range); x, ids, weights and out are contiguous row-major.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"
#include "quant_blocks.h"
#include "quant_dot.h"
#include "simd.h"

namespace {

constexpr int64_t kColumnsPerTask = 64;  // output columns per OpenMP work item

// One stacked expert matrix: `rows` rows per expert of K values in GGUF type qtype.
struct Experts {
  const uint8_t* w;
  int qtype;
  int64_t rows, K;
  int64_t row_bytes() const { return K / layout(qtype).values * layout(qtype).bytes; }
  const uint8_t* expert(int64_t e) const { return w + e * rows * row_bytes(); }
};

// The (token, slot) pairs grouped by expert: chosen[c] the c-th chosen expert (ascending), its pairs
// at begin[c] .. begin[c + 1] of `token` (ascending); at[t * k + j] the place of pair (t, j).
struct Routing {
  std::vector<int64_t> chosen, begin, token, at;
};

// Routing of ids [T, k]; false (nothing else done) if an id lies outside [0, E).
bool route(const int64_t* ids, int64_t T, int64_t k, int64_t E, Routing& r) {
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) {
    if (ids[p] < 0 || ids[p] >= E) return false;
    ++count[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];  // count[e]: where expert e's pairs start
  r.token.assign(T * k, 0);
  r.at.assign(T * k, 0);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) {
    r.at[p] = next[ids[p]]++;
    r.token[r.at[p]] = p / k;
  }
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) {
      r.chosen.push_back(e);
      r.begin.push_back(count[e]);
    }
  r.begin.push_back(T * k);
  return true;
}

#if defined(__AVX2__)

// The rows an expert's product reads: quantized for its format (quant_dot.h).
using Input = Activations;

// Activations are padded to a multiple of a format's step, as quant.cpp's products pad them.
int64_t padded(int qtype, int64_t K) {
  const int64_t step = std::max<int64_t>(layout(qtype).values, kVecValues);
  return (K + step - 1) / step * step;
}

// Whether one quantization of the rows serves products of both types (the same fields, offset and
// padding).
bool shared_input(int qa, int qb, int64_t K) {
  return superblock_int(qa) == superblock_int(qb) && offset_of(qa) == offset_of(qb) && padded(qa, K) == padded(qb, K);
}

// Rows for the products of type qtype: quantized, and from kPanelMinRows rows on laid out in panels
// too (quant_panel.h).
template <typename T>
void make_input(const T* rows, int64_t n, int64_t K, int qtype, Input& in) {
  quantize_activations(rows, n, K, padded(qtype, K), qtype, in);
  if (n >= kPanelMinRows) build_panel(in, n);
}

// in's rows `rows[0 .. n)` copied into out, in that order (in panels too from kPanelMinRows rows on).
void gather(const Input& in, const int64_t* rows, int64_t n, Input& out) {
  gather_activations(in, rows, n, out);
  if (n >= kPanelMinRows) build_panel(out, n);
}

// out[m * stride + n - begin] = in row m . W row n of expert e, for n in [begin, end), m < n_rows.
void product(const Experts& m, int64_t e, const Input& in, int64_t n_rows, int64_t begin, int64_t end, float* out,
             int64_t stride) {
  const uint8_t* w = m.expert(e);
  const int64_t rb = m.row_bytes();
  const float* none = nullptr;
  float* o = out - begin;
  switch (m.qtype) {
    case kQ8_0: column_range<kQ8_0>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ4_0: column_range<kQ4_0>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ4_1: column_range<kQ4_1>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ5_0: column_range<kQ5_0>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ5_1: column_range<kQ5_1>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kIQ4_NL: column_range<kIQ4_NL>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kIQ4_XS: column_range<kIQ4_XS>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ3_K: column_range<kQ3_K>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ2_K: column_range<kQ2_K>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ4_K: column_range<kQ4_K>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ5_K: column_range<kQ5_K>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    case kQ6_K: column_range<kQ6_K>(w, rb, in, none, o, stride, n_rows, m.K, begin, end); break;
    default: break;
  }
}

#else  // no AVX2: the rows in fp32, each row of W dequantized

struct Input {
  int64_t K = 0;
  std::vector<float> x;  // [n, K]
};

bool shared_input(int, int, int64_t) { return true; }

template <typename T>
void make_input(const T* rows, int64_t n, int64_t K, int, Input& in) {
  in.K = K;
  in.x.resize(n * K);
  for (int64_t i = 0; i < n * K; ++i) in.x[i] = to_float(rows[i]);
}

void gather(const Input& in, const int64_t* rows, int64_t n, Input& out) {
  out.K = in.K;
  out.x.resize(n * in.K);
  for (int64_t i = 0; i < n; ++i) std::memcpy(&out.x[i * in.K], &in.x[rows[i] * in.K], in.K * sizeof(float));
}

void product(const Experts& m, int64_t e, const Input& in, int64_t n_rows, int64_t begin, int64_t end, float* out,
             int64_t stride) {
  std::vector<float> row(m.K);
  for (int64_t n = begin; n < end; ++n) {
    dequantize_row_scalar(m.qtype, m.expert(e) + n * m.row_bytes(), m.K, row.data());
    for (int64_t r = 0; r < n_rows; ++r) {
      float s = 0.0f;
      for (int64_t i = 0; i < m.K; ++i) s += row[i] * in.x[r * m.K + i];
      out[r * stride + n - begin] = s;
    }
  }
}

#endif

// The routed FFN (see the header comment); ids checked by the caller.
template <typename T>
void moe_ffn(const T* x, const Experts& gate, const Experts& up, const Experts& down, const Routing& r,
             const float* weights, T* out, int64_t T_rows, int64_t k, int num_threads) {
  const int64_t H = gate.K, I = gate.rows, n_chosen = static_cast<int64_t>(r.chosen.size()), pairs = T_rows * k;
  // Step 1: x quantized once per format (once in all when gate and up share it), each chosen
  // expert's rows gathered (or all of x, in order, when it takes every token: decode).
  const bool shared = shared_input(gate.qtype, up.qtype, H);
  Input x_gate, x_up;
  make_input(x, T_rows, H, gate.qtype, x_gate);
  if (!shared) make_input(x, T_rows, H, up.qtype, x_up);
  std::vector<Input> own_gate(n_chosen), own_up(shared ? 0 : n_chosen), h_in(n_chosen);
  std::vector<const Input*> in_gate(n_chosen), in_up(n_chosen);
  // Every element of gu, h and y is written (steps 2, 3, 4) before it is read, so they are left
  // uninitialised rather than zeroed (megabytes at a batch's 64 tokens).
  const std::unique_ptr<float[]> gu(new float[pairs * 2 * I]), h(new float[pairs * I]), y(new float[pairs * H]);
  const int64_t up_tasks = (I + kColumnsPerTask - 1) / kColumnsPerTask, down_tasks = (H + kColumnsPerTask - 1) / kColumnsPerTask;
  const auto rows_of = [&](int64_t c) { return r.begin[c + 1] - r.begin[c]; };
  const auto prepare = [&](int64_t c) {  // step 1's gather for chosen expert c
    if (rows_of(c) == T_rows) {  // every token, in order
      in_gate[c] = &x_gate;
      in_up[c] = shared ? &x_gate : &x_up;
      return;
    }
    gather(x_gate, r.token.data() + r.begin[c], rows_of(c), own_gate[c]);
    in_gate[c] = &own_gate[c];
    if (!shared) gather(x_up, r.token.data() + r.begin[c], rows_of(c), own_up[c]);
    in_up[c] = shared ? &own_gate[c] : &own_up[c];
  };
  const auto gate_up_task = [&](int64_t c, int64_t task) {  // step 2: row i of c's block of gu is its pair i
    const int64_t part = task / up_tasks, begin = (task % up_tasks) * kColumnsPerTask;
    product(part == 0 ? gate : up, r.chosen[c], part == 0 ? *in_gate[c] : *in_up[c], rows_of(c), begin,
            std::min(I, begin + kColumnsPerTask), gu.get() + r.begin[c] * 2 * I + part * I + begin, 2 * I);
  };
  const auto hidden = [&](int64_t c) {  // step 3: silu(gate) * up, quantized for down
    float* hc = h.get() + r.begin[c] * I;
    nanoserve_silu_mul_f32(gu.get() + r.begin[c] * 2 * I, hc, rows_of(c), I, 1);
    make_input(hc, rows_of(c), I, down.qtype, h_in[c]);
  };
  const auto down_task = [&](int64_t c, int64_t task) {  // step 4
    const int64_t begin = task * kColumnsPerTask;
    product(down, r.chosen[c], h_in[c], rows_of(c), begin, std::min(H, begin + kColumnsPerTask),
            y.get() + r.begin[c] * H + begin, H);
  };
  // With at least two chosen experts per thread (decode: k experts for one token) a work item is a
  // whole expert, steps 1-4, and the threads meet only before step 5; with fewer (a few busy experts,
  // or more threads than experts) each step's items are shared out in turn. The same products
  // either way (column_range's outputs do not depend on its range), so the same bits.
  const bool whole_experts = n_chosen >= 2 * num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    if (whole_experts) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < n_chosen; ++c) {
        prepare(c);
        for (int64_t task = 0; task < 2 * up_tasks; ++task) gate_up_task(c, task);
        hidden(c);
        for (int64_t task = 0; task < down_tasks; ++task) down_task(c, task);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < n_chosen; ++c) prepare(c);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < n_chosen * 2 * up_tasks; ++item) gate_up_task(item / (2 * up_tasks), item % (2 * up_tasks));
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < n_chosen; ++c) hidden(c);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < n_chosen * down_tasks; ++item) down_task(item / down_tasks, item % down_tasks);
    }
    // Step 5: each token's weighted sum over its slots, in slot order.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T_rows; ++t) {
      std::vector<float> acc(H, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float wj = weights[t * k + j];
        const float* yj = y.get() + r.at[t * k + j] * H;
        for (int64_t i = 0; i < H; ++i) acc[i] += wj * yj[i];
      }
      for (int64_t i = 0; i < H; ++i) from_float(acc[i], out + t * H + i);
    }
  }
}

// Whether this file takes GGUF type qtype with rows of K values (whole blocks).
bool takes(int qtype, int64_t K) { return layout(qtype).values != 0 && K % layout(qtype).values == 0; }

template <typename T>
int checked_moe_ffn(const T* x, const uint8_t* gate, int gate_qtype, const uint8_t* up, int up_qtype,
                    const uint8_t* down, int down_qtype, const int64_t* ids, const float* weights, T* out, int64_t T_rows,
                    int64_t k, int64_t E, int64_t H, int64_t I, int num_threads) {
  if (!takes(gate_qtype, H) || !takes(up_qtype, H) || !takes(down_qtype, I) || T_rows < 0 || k < 1 || E < 1 ||
      I < 1)
    return 0;
  Routing r;
  if (!route(ids, T_rows, k, E, r)) return -1;
  if (T_rows == 0) return 1;
  moe_ffn(x, Experts{gate, gate_qtype, I, H}, Experts{up, up_qtype, I, H}, Experts{down, down_qtype, H, I}, r, weights,
          out, T_rows, k, num_threads);
  return 1;
}

}  // namespace

extern "C" {

// out [T, H] = the routed FFN of x [T, H] (see the header comment) for experts gate, up [E * I,
// row_bytes(H)] and down [E * H, row_bytes(I)] in GGUF types gate_qtype, up_qtype, down_qtype,
// ids [T, k] in [0, E), weights [T, k]. Returns 1; 0 (writing nothing) for a type or width it does
// not take; -1 (writing nothing) for an id outside [0, E).
int nanoserve_moe_ffn_f32(const float* x, const uint8_t* gate, int gate_qtype, const uint8_t* up, int up_qtype,
                          const uint8_t* down, int down_qtype, const int64_t* ids, const float* weights, float* out,
                          int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int num_threads) {
  return checked_moe_ffn(x, gate, gate_qtype, up, up_qtype, down, down_qtype, ids, weights, out, T, k, E, H, I,
                         num_threads);
}
int nanoserve_moe_ffn_bf16(const uint16_t* x, const uint8_t* gate, int gate_qtype, const uint8_t* up, int up_qtype,
                           const uint8_t* down, int down_qtype, const int64_t* ids, const float* weights,
                           uint16_t* out, int64_t T, int64_t k, int64_t E, int64_t H, int64_t I, int num_threads) {
  return checked_moe_ffn(x, gate, gate_qtype, up, up_qtype, down, down_qtype, ids, weights, out, T, k, E, H, I,
                         num_threads);
}

}  // extern "C"
