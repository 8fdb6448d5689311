// y = x W^T (+ b) for a few rows of x: the matrix products of decode steps, of verification steps
// carrying a few drafts, and of the LM head over the sampled rows.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there). A BLAS
// GEMM is tuned for large M: on an AVX2 EPYC, MKL's fp32 GEMM takes ~3x as long for 5 rows as for 1,
// and torch's bf16 product without native bf16 instructions moves half the bytes it could. Here
// every row of W (in place, [N, K] row-major as checkpoints store it: no packed copy) is read once
// for all rows of x, while it sits in L1: each W vector feeds one FMA per row of x, so a few rows
// cost little more than one and a single row runs at memory speed. bf16 weights are widened to
// fp32 in registers (a shift), so a bf16 model streams half the bytes of an fp32 one; accumulation
// is in fp32 and only the output is rounded to T.
//
// Structure: output columns are shared among `num_threads` OpenMP threads in blocks; in each block,
// kRowsW rows of W at a time against the rows of x in groups of up to kRowsX, with kRowsW x kRowsX
// vector accumulators (each reduced by one horizontal sum at the end). x is widened to fp32 once,
// into a buffer, when T is bf16.
//
// Layouts (all contiguous): x [M, K], w [N, K], bias [N] or null, out [M, N].

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace nanoserve;

constexpr int kRowsW = 4;                 // rows of W per pass over K
constexpr int kRowsX = 2;                 // rows of x per pass (kRowsW * kRowsX accumulators)
constexpr int64_t kColumnsPerTask = 64;   // output columns per OpenMP work item
constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all

// out[m][n0 + j] for j < NW, m < MX: NW rows of W (stride K) against MX rows of xf (stride K).
template <typename T, int NW, int MX>
inline void dot_block(const float* xf, const T* w, int64_t K, float (*res)[kRowsW]) {
  vec8 acc[MX][NW] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec8 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = load8(w + j * K + k);
    for (int m = 0; m < MX; ++m) {
      const vec8 xv = load8(xf + m * K + k);
      for (int j = 0; j < NW; ++j) acc[m][j] += wv[j] * xv;
    }
  }
  for (int m = 0; m < MX; ++m)
    for (int j = 0; j < NW; ++j) {
      float s = hsum(acc[m][j]);
      for (int64_t t = k; t < K; ++t) s += xf[m * K + t] * to_float(w[j * K + t]);
      res[m][j] = s;
    }
}

template <typename T, int NW>
void columns(const float* xf, const T* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K, int64_t n0) {
  float res[kRowsX][kRowsW];
  for (int64_t m0 = 0; m0 < M; m0 += kRowsX) {
    const int mx = static_cast<int>(std::min<int64_t>(kRowsX, M - m0));
    if (mx == kRowsX)
      dot_block<T, NW, kRowsX>(xf + m0 * K, w + n0 * K, K, res);
    else
      dot_block<T, NW, 1>(xf + m0 * K, w + n0 * K, K, res);
    for (int m = 0; m < mx; ++m)
      for (int j = 0; j < NW; ++j)
        from_float(res[m][j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.0f), out + (m0 + m) * N + n0 + j);
  }
}

template <typename T>
void linear(const T* x, const T* w, const T* bias, T* out, int64_t M, int64_t N, int64_t K, int num_threads) {
  std::vector<float> widened;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    widened.resize(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) widened[i] = to_float(x[i]);
    xf = widened.data();
  }
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M * N * K >= kParallelWork)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t end = std::min(N, (task + 1) * kColumnsPerTask);
    int64_t n = task * kColumnsPerTask;
    for (; n + kRowsW <= end; n += kRowsW) columns<T, kRowsW>(xf, w, bias, out, M, N, K, n);
    for (; n < end; ++n) columns<T, 1>(xf, w, bias, out, M, N, K, n);
  }
}

}  // namespace

extern "C" {

// out = x w^T + bias (bias may be null) for x [M, K], w [N, K]; any M, meant for small ones.
void nanoserve_linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N,
                          int64_t K, int num_threads) {
  linear(x, w, bias, out, M, N, K, num_threads);
}
void nanoserve_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                           int64_t N, int64_t K, int num_threads) {
  linear(x, w, bias, out, M, N, K, num_threads);
}

}  // extern "C"
