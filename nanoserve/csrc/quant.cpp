// y = x W^T (+ b) with W in GGUF's block formats (quant_blocks.h's list), kept quantized,
// and the rows of such a W dequantized (embedding gathers): the entry
// points that kernels.h declares, their checks, and the choice of path per product.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there). One
// translation unit with private headers, each included here only, by job:
//   quant_isa.h     the path (AVX512-VNNI, AVX-VNNI, AVX2, scalar) the flags select, and the
//                   vector operations the others are written in
//   quant_blocks.h  the GGUF block formats: layouts, unpacking of W's groups, row dequantization
//   quant_dot.h     the int8 dot products: activation quantization, dot_block, column_range
//   quant_panel.h   the products of many rows of x (an outer-product kernel)
//   quant_amx.h     the superblock_int formats' products of many rows of x on AMX-INT8 tiles
// Without AVX2 a plain scalar loop (here) dequantizes each row of W and multiplies it with x in
// fp32 (no activation quantization). nanoserve_quant_isa reports which path the build takes.
//
// Structure (as linear.cpp): output columns shared among OpenMP threads in tasks of 64 rows of W,
// each task quant_dot.h's column_range (below kPanelMinRows rows of x, SharedTasks: each thread's
// stretch of tasks, then what is left of the others'). Every product with a block-quantized W comes
// here, for any number of rows of x: one arithmetic per weight format (activations quantized to 8
// bits per block of 32, or per super-block for the k-quants), so each output is the same bits
// whatever else shares the step (batch invariance: no switch to a GEMM on dequantized tiles past
// some number of rows, which would sum other values in another order; the panel kernel and, on CPUs
// with AMX, the tile kernel compute the same exact integer terms and the same fp32 steps as the
// pair kernels).
//
// Layouts: x [M, K] contiguous; W [N, row_bytes] (quant_blocks.h); bias [N] or null (x's type); out
// row m at out + m * out_stride (out_stride >= N: a fused matrix's parts write column slices of one
// output). Invariants: an entry point writes nothing unless it returns 1 (a type and K it takes,
// row indices in range).

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels.h"
#include "quant_blocks.h"
#include "quant_dot.h"
#include "simd.h"

namespace {

constexpr int64_t kColumnsPerTask = 64;    // output columns per OpenMP work item
constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all

#if defined(__AVX2__)

// Tasks [0, n) of a parallel region's threads, cut into equal shares of consecutive tasks, one per
// thread the region asked for. Each thread runs the tasks of its own share in order, then those
// left in the others' (each share's next task, as its owner takes them): every thread reads runs of
// consecutive tasks, as with a static schedule, but a thread whose reads came slower is helped to
// the end of its share instead of waited for. Every task runs exactly once, on one thread; which
// thread does not change what a task computes.
class SharedTasks {
 public:
  SharedTasks(int64_t n, int num_shares) : n_(n), shares_(std::max(num_shares, 1)), next_(new Next[shares_]) {
    for (int64_t s = 0; s < shares_; ++s) next_[s].task.store(first(s), std::memory_order_relaxed);
  }
  // Called by every thread of the region: runs tasks until none is left.
  template <typename Run>
  void run(Run&& task) {
    const int64_t own = omp_get_thread_num() % shares_;
    for (int64_t k = 0; k < shares_; ++k) {
      const int64_t s = (own + k) % shares_, end = first(s + 1);
      for (int64_t i; (i = next_[s].task.fetch_add(1, std::memory_order_relaxed)) < end;) task(i);
    }
  }

 private:
  struct alignas(64) Next {  // one cache line per share: the owners' counters do not contend
    std::atomic<int64_t> task;
  };
  int64_t first(int64_t s) const { return n_ * s / shares_; }  // share s's first task
  int64_t n_, shares_;
  std::unique_ptr<Next[]> next_;
};

// out = x W^T (+ bias) for W of type Q by the int8 dot products, tasks of kColumnsPerTask columns
// shared among the threads (one thread below kParallelWork multiply-adds).
template <int Q, typename T, typename O>
void products(const T* x, const uint8_t* w, const T* bias, O* out, int64_t out_stride, int64_t M, int64_t N,
              int64_t K, int num_threads) {
  constexpr int64_t step = std::max<int64_t>(layout(Q).values, kVecValues);
  const int64_t row_bytes = K / layout(Q).values * layout(Q).bytes, Kp = (K + step - 1) / step * step;
  // x quantized (and, from kPanelMinRows rows on, laid out in panels for quant_panel.h or, the
  // superblock_int formats where amx_usable, for quant_amx.h: size_panel chooses), then the
  // products. From kPanelMinRows rows on the threads share the rows, then the panel groups (each
  // step one more meeting of the threads), then the tasks.
  Activations a;
  size_activations(a, M, Kp, Q);
  const bool panel = M >= kPanelMinRows;
  if (panel)
    size_panel(a, M);
  else
    quantize_rows(x, 0, M, K, Q, a);
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask, groups = (M + kPanelRows - 1) / kPanelRows;
  const bool parallel = num_threads > 1 && M * N * K >= kParallelWork;
  const auto task = [&](int64_t i) {
    column_range<Q>(w, row_bytes, a, bias, out, out_stride, M, K, i * kColumnsPerTask,
                    std::min(N, (i + 1) * kColumnsPerTask));
  };
  if (!panel) {  // few rows: W's reads, whose pace differs between threads, set the time
    SharedTasks shared(tasks, parallel ? num_threads : 1);
#pragma omp parallel num_threads(num_threads) if (parallel)
    shared.run(task);
    return;
  }
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_rows(x, m, m + 1, K, Q, a);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) panel_groups(a, M, g, g + 1);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tasks; ++i) task(i);
  }
}

template <typename T, typename O>
void quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, O* out, int64_t out_stride, int64_t M,
                  int64_t N, int64_t K, int num_threads) {
  switch (qtype) {
    case kQ8_0: products<kQ8_0>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ4_0: products<kQ4_0>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ4_1: products<kQ4_1>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ5_0: products<kQ5_0>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ5_1: products<kQ5_1>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kIQ4_NL: products<kIQ4_NL>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kIQ4_XS: products<kIQ4_XS>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ3_K: products<kQ3_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ2_K: products<kQ2_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ4_K: products<kQ4_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ5_K: products<kQ5_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ6_K: products<kQ6_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    default: break;
  }
}

#else  // no AVX2: each row of W dequantized, then multiplied with x in fp32

template <typename T, typename O>
void quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, O* out, int64_t out_stride, int64_t M,
                  int64_t N, int64_t K, int num_threads) {
  const BlockLayout b = layout(qtype);
  const int64_t row_bytes = K / b.values * b.bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M * N * K >= kParallelWork)
  for (int64_t n = 0; n < N; ++n) {
    std::vector<float> row(K);
    dequantize_row_scalar(qtype, w + n * row_bytes, K, row.data());
    for (int64_t m = 0; m < M; ++m) {
      float s = bias != nullptr ? to_float(bias[n]) : 0.0f;
      for (int64_t k = 0; k < K; ++k) s += row[k] * to_float(x[m * K + k]);
      from_float(s, out + m * out_stride + n);
    }
  }
}

#endif

// Rows of W [.., K] as T: out row i = W row rows[i] (rows null: row i).
template <typename T>
void dequantize_rows(const uint8_t* w, int qtype, int64_t K, const int64_t* rows, int64_t n, T* out,
                     int num_threads) {
  const int64_t row_bytes = K / layout(qtype).values * layout(qtype).bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && n * K >= kParallelWork)
  for (int64_t i = 0; i < n; ++i)
    dequantize_row_any(qtype, w + (rows != nullptr ? rows[i] : i) * row_bytes, K, out + i * K);
}

// Whether this file takes GGUF type qtype with rows of K values (whole blocks).
bool takes(int qtype, int64_t K) { return layout(qtype).values != 0 && K % layout(qtype).values == 0; }

// The entry points' checks around quant_linear and dequantize_rows (see their declarations below).
template <typename T, typename O>
int checked_quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, O* out, int64_t out_stride,
                         int64_t M, int64_t N, int64_t K, int num_threads) {
  if (!takes(qtype, K)) return 0;
  quant_linear(x, w, qtype, bias, out, out_stride, M, N, K, num_threads);
  return 1;
}

template <typename T>
int checked_dequantize_rows(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows, int64_t n,
                            T* out, int num_threads) {
  if (!takes(qtype, K)) return 0;
  for (int64_t i = 0; rows != nullptr && i < n; ++i)
    if (rows[i] < 0 || rows[i] >= num_rows) return -1;
  if (rows == nullptr && n > num_rows) return -1;
  dequantize_rows(w, qtype, K, rows, n, out, num_threads);
  return 1;
}

}  // namespace

extern "C" {

// out[m * out_stride + n] = x[m] . W[n] + bias[n] for W [N, K] in GGUF type qtype (K a multiple of
// its block; returns 0, writing nothing, for a type or K this file does not take, else 1).
int nanoserve_quant_linear_f32(const float* x, const uint8_t* w, int qtype, const float* bias, float* out,
                               int64_t out_stride, int64_t M, int64_t N, int64_t K, int num_threads) {
  return checked_quant_linear(x, w, qtype, bias, out, out_stride, M, N, K, num_threads);
}
int nanoserve_quant_linear_bf16(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* bias, uint16_t* out,
                                int64_t out_stride, int64_t M, int64_t N, int64_t K, int num_threads) {
  return checked_quant_linear(x, w, qtype, bias, out, out_stride, M, N, K, num_threads);
}
// The same products with the fp32 sums written as they are (no rounding to bf16): the LM head.
int nanoserve_quant_linear_bf16_out_f32(const uint16_t* x, const uint8_t* w, int qtype, const uint16_t* bias,
                                        float* out, int64_t out_stride, int64_t M, int64_t N, int64_t K,
                                        int num_threads) {
  return checked_quant_linear(x, w, qtype, bias, out, out_stride, M, N, K, num_threads);
}

// out[i] = W[rows[i]] dequantized (rows null: W[i]), i < n, for W [num_rows, K] in GGUF type qtype.
// Returns 1; 0 for a type or K it does not take; -1 for a row index outside [0, num_rows). Nothing
// is written unless it returns 1.
int nanoserve_dequantize_rows_f32(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows,
                                  int64_t n, float* out, int num_threads) {
  return checked_dequantize_rows(w, qtype, num_rows, K, rows, n, out, num_threads);
}
int nanoserve_dequantize_rows_bf16(const uint8_t* w, int qtype, int64_t num_rows, int64_t K, const int64_t* rows,
                                   int64_t n, uint16_t* out, int num_threads) {
  return checked_dequantize_rows(w, qtype, num_rows, K, rows, n, out, num_threads);
}

// Which dot product the quantized products use: 3 AVX512-VNNI, 2 AVX-VNNI (256-bit), 1 AVX2
// (vpmaddubsw), 0 none (scalar, fp32).
int nanoserve_quant_isa() { return kIsa; }
// Whether the superblock_int formats' products of kPanelMinRows rows of x or more take AMX-INT8 tiles
// (quant_amx.h): 1 where this build has that path and this CPU and process may use it, else 0.
int nanoserve_quant_amx() { return amx_usable() ? 1 : 0; }

}  // extern "C"
