// y = x W^T (+ b) on the CPU, in fp32 and bf16, for any number of rows of x: every product of a
// dense model on nanoserve's CPU path, decode steps and prefill chunks alike.
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there). A BLAS
// GEMM is tuned for large M: MKL's fp32 GEMM costs several times as much for 5 rows as for 1, and
// torch's bf16 product, without native bf16 instructions, is emulated and moves more bytes than a
// matrix-vector product needs. Here every row of W (in place, [N, K] row-major as checkpoints store
// it: no packed copy) is read once for a whole block of rows of x, while it sits in L1: each W
// vector feeds one FMA per row of x, so a single row runs at memory speed and more rows add
// arithmetic, not traffic. bf16 weights are widened to fp32 in registers (a shift), so a bf16 model
// streams half the bytes of an fp32 one; accumulation is in fp32 and only the output is rounded to T.
//
// Structure: x in blocks of 64 rows (which stay in L2); for each, output columns are shared among
// `num_threads` OpenMP threads in blocks of 64; in each, a few rows of W at a time against the rows
// of x in groups of up to four, with kChainsF32 vector accumulators per (row of W, row of x),
// reduced by one horizontal sum at the end (on the vdpbf16ps path, long rows against several rows
// of x the other way round: three rows of x against each pair of the task's rows of W in turn). x
// is widened to fp32 once, into a buffer, when T is bf16.
//
// Invariant (batch invariance): each output's sequence of floating-point operations depends on K,
// on its row of x and its row of W only, never on M, on the row's place among the rows of x, on
// the column's place in a range or on the thread count: the groupings above only decide which
// outputs are computed side by side. So a request's rows give the same bits whatever shares the
// step. (The cost: large-M fp32 and AVX512-BF16 products stay here rather than in torch's GEMM,
// which sums in another order; docs/benchmarks.md, "One answer per prompt".)
//
// On CPUs with AVX512-BF16 (built with -march=native there) bf16 takes another inner loop: x stays
// bf16 and each instruction (vdpbf16ps) multiplies 32 pairs of bf16 values exactly and adds them, two
// by two, into 16 fp32 accumulators; no widening, and twice the multiply-adds of an fp32 FMA per
// instruction. Its results differ from the widening loop's only in the order of the fp32 additions (and in
// flushing subnormal inputs and results to zero, as the instruction does).
//
// Layouts (all contiguous): x [M, K], w [N, K], bias [N] or null, out [M, N].

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "simd.h"

namespace {

using namespace nanoserve;

#if defined(__AVX512F__)
constexpr int kRowsX = 4;  // rows of x per pass over K, at most (5 on the vdpbf16ps path when 5 remain)
#else
constexpr int kRowsX = 3;  // (16 vector registers: 3 x 2 x 2 accumulators, the W vectors and one of x)
#endif
constexpr int64_t kRowsPerBlock = 64;      // rows of x per pass over all of W
constexpr int64_t kColumnsPerTask = 64;    // output columns per OpenMP work item
constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all
constexpr int64_t kRowStreamK = 1024;      // vdpbf16ps: from this K, W a row or two at a time (long rows)
constexpr int64_t kPairRowsX = 5;          // vdpbf16ps, long rows: from this many rows of x, W two rows at a time
constexpr int kChainsF32 = 2;              // fp32 loop: accumulators per (row of x, row of W)

// res[m][j] = xf[m] . w[j] for m < MX, j < NW: NW rows of W (stride K) against MX rows of xf
// (stride K), with U = kChainsF32 vector accumulators per (m, j) over interleaved stretches of K
// (at least eight FMA chains in flight for one row of x by four of W, or more rows of x: an FMA's
// latency is four or five cycles, and two issue per cycle). U is the same for every NW and MX, so
// each output takes the same sequence of operations whatever the number of rows of x and its
// place among them (batch invariance). The next NW rows of W are prefetched meanwhile: the NW
// interleaved streams defeat the hardware prefetcher.
template <typename T, int NW, int MX>
inline void dot_block(const float* xf, const T* w, int64_t K, float (*res)[8]) {
  constexpr int U = kChainsF32;
  vec8 acc[U][MX][NW] = {};
  int64_t k = 0;
  for (; k + U * kLanes <= K; k += U * kLanes) {
    for (int u = 0; u < U; ++u) {
      const int64_t ku = k + u * kLanes;
      if ((ku * sizeof(T)) % 64 == 0)  // the next NW rows, a cache line at a time (a prefetch never faults)
        for (int j = NW; j < 2 * NW; ++j) __builtin_prefetch(w + j * K + ku, 0, 0);
      vec8 wv[NW];
      for (int j = 0; j < NW; ++j) wv[j] = load8(w + j * K + ku);
      for (int m = 0; m < MX; ++m) {
        const vec8 xv = load8(xf + m * K + ku);
        for (int j = 0; j < NW; ++j) acc[u][m][j] += wv[j] * xv;
      }
    }
  }
  for (; k + kLanes <= K; k += kLanes)  // what is left of K in whole vectors
    for (int m = 0; m < MX; ++m) {
      const vec8 xv = load8(xf + m * K + k);
      for (int j = 0; j < NW; ++j) acc[0][m][j] += load8(w + j * K + k) * xv;
    }
  for (int m = 0; m < MX; ++m)
    for (int j = 0; j < NW; ++j) {
      vec8 sum = acc[0][m][j];
      for (int u = 1; u < U; ++u) sum += acc[u][m][j];
      float s = hsum(sum);
      for (int64_t t = k; t < K; ++t) s += xf[m * K + t] * to_float(w[j * K + t]);
      res[m][j] = s;
    }
}

#if defined(__AVX512BF16__)
constexpr bool kDotBf16 = true;

// The sums of the 16 lanes of each of a, b, c, d, in one tree: with K of a few hundred, reducing
// each accumulator on its own costs as much as the multiply-adds.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const auto fold = [](__m512 v) {  // 16 lanes -> 8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(fold(a), fold(b)), _mm256_hadd_ps(fold(c), fold(d)));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// MX rows of x against NW rows of W with vdpbf16ps, for long rows (K >= kRowStreamK): four
// accumulators per (row of x, row of W) (interleaved stretches of 32 values) so that four chains
// are in flight for a single output, each output reduced by the same tree whatever NW and MX. NW is
// 1 for a few rows of x: W then streams as one sequential run, which the hardware prefetcher follows
// best (faster than several rows read side by side; software prefetches only slow it). From
// kPairRowsX rows of x on, where the arithmetic costs more than W's bytes, NW is 2 against 3 rows of
// x (24 accumulators): each x vector loaded feeds two instructions instead of one.
template <int NW, int MX>
inline void dot_long_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float (*res)[8]) {
  __m512 acc[MX][NW][4];
  for (int m = 0; m < MX; ++m)
    for (int j = 0; j < NW; ++j)
      for (int u = 0; u < 4; ++u) acc[m][j][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
    for (int u = 0; u < 4; ++u) {
      __m512bh wv[NW];
      for (int j = 0; j < NW; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k + 32 * u);
      for (int m = 0; m < MX; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u);
        for (int j = 0; j < NW; ++j) acc[m][j][u] = _mm512_dpbf16_ps(acc[m][j][u], xv, wv[j]);
      }
    }
  for (; k + 32 <= K; k += 32) {
    for (int m = 0; m < MX; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int j = 0; j < NW; ++j)
        acc[m][j][0] = _mm512_dpbf16_ps(acc[m][j][0], xv, (__m512bh)_mm512_loadu_si512(w + j * K + k));
    }
  }
  if (k < K) {
    const __mmask32 mask = (__mmask32{1} << (K - k)) - 1;
    for (int m = 0; m < MX; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int j = 0; j < NW; ++j)
        acc[m][j][1] = _mm512_dpbf16_ps(acc[m][j][1], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k));
    }
  }
  for (int m = 0; m < MX; ++m)
    for (int j = 0; j < NW; ++j) {
      const __m128 sums = hsum4(acc[m][j][0], acc[m][j][1], acc[m][j][2], acc[m][j][3]);
      res[m][j] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    }
}

// dot_block for bf16 x (stride K) against bf16 W with vdpbf16ps: one zmm accumulator per (m, j),
// 32 values of K per instruction (K's last partial stretch through masked loads, which read zeros),
// each reduced by hsum4's tree whatever NW; long rows (one or two rows of W at a time) by
// dot_long_bf16.
template <int NW, int MX>
inline void dot_block_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float (*res)[8]) {
  if constexpr (NW == 1 || (NW == 2 && MX <= 3)) {
    if (K >= kRowStreamK) {
      dot_long_bf16<NW, MX>(x, w, K, res);
      return;
    }
  }
  __m512 acc[MX][NW];
  for (int m = 0; m < MX; ++m)
    for (int j = 0; j < NW; ++j) acc[m][j] = _mm512_setzero_ps();
  const auto step = [&](int64_t k, auto load) {
    __m512i wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = load(w + j * K + k);
    for (int m = 0; m < MX; ++m) {
      const __m512bh xv = (__m512bh)load(x + m * K + k);
      for (int j = 0; j < NW; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, (__m512bh)wv[j]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, [](const uint16_t* p) { return _mm512_loadu_si512(p); });
  if (k < K) {
    const __mmask32 mask = (__mmask32{1} << (K - k)) - 1;
    step(k, [mask](const uint16_t* p) { return _mm512_maskz_loadu_epi16(mask, p); });
  }
  for (int m = 0; m < MX; ++m) {
    if constexpr (NW % 4 == 0) {
      for (int j = 0; j < NW; j += 4)
        _mm_storeu_ps(res[m] + j, hsum4(acc[m][j], acc[m][j + 1], acc[m][j + 2], acc[m][j + 3]));
    } else {  // the same tree as above, for the last columns of a range
      const __m512 zero = _mm512_setzero_ps();
      for (int j = 0; j < NW; ++j) res[m][j] = hsum4(acc[m][j], zero, zero, zero)[0];
    }
  }
}
#else
constexpr bool kDotBf16 = false;
#endif

// The inner loop for x of type X (float, or bf16 on the vdpbf16ps path) against W of type T.
template <typename X, typename T, int NW, int MX>
inline void dot(const X* x, const T* w, int64_t K, float (*res)[8]) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, uint16_t>) {
    dot_block_bf16<NW, MX>(x, w, K, res);
  } else
#endif
  {
    static_assert(std::is_same_v<X, float>, "bf16 x only on the vdpbf16ps path");
    dot_block<T, NW, MX>(x, w, K, res);
  }
}

// Output columns [n0, n0 + NW) for every row of x, kRowsX rows of x at a time (W's NW rows stay in
// L1 meanwhile). The vdpbf16ps path takes five when there are five (a decode step's last token and
// four drafts in one pass: twenty accumulators, where 4 + 1 rows would leave the fifth row's pass
// with four dependency chains). Two long rows of W on that path get three rows of x at most
// (column_range_rows_outer passes no more).
template <typename X, typename T, typename O, int NW>
void columns(const X* xf, const T* w, const T* bias, O* out, int64_t M, int64_t N, int64_t K, int64_t n0) {
  static_assert(NW <= 8, "res holds 8 columns");
  constexpr bool dp = !std::is_same_v<X, float>;
  float res[kRowsX + 1][8];
  for (int64_t m0 = 0, mx; m0 < M; m0 += mx) {
    const X* x0 = xf + m0 * K;
    const T* w0 = w + n0 * K;
    mx = std::min<int64_t>(kRowsX + (dp && M - m0 == kRowsX + 1), M - m0);
    switch (mx) {
      case 5:
        if constexpr (dp) dot<X, T, NW, 5>(x0, w0, K, res);
        break;
      case 4: dot<X, T, NW, 4>(x0, w0, K, res); break;
      case 3: dot<X, T, NW, 3>(x0, w0, K, res); break;
      case 2: dot<X, T, NW, 2>(x0, w0, K, res); break;
      default: dot<X, T, NW, 1>(x0, w0, K, res); break;
    }
    for (int m = 0; m < mx; ++m)
      for (int j = 0; j < NW; ++j)
        from_float(res[m][j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.0f), out + (m0 + m) * N + n0 + j);
  }
}

// One row of x streams W four rows at a time (each over two interleaved stretches of K: eight FMA
// chains, four memory streams; eight streams are slower on bf16 weights beyond L3); more
// rows of x take W two rows at a time against up to four of theirs, so that each W vector loaded
// (and, for bf16, widened) feeds four FMAs. On the vdpbf16ps path, long rows take W one row at a
// time (dot_long_bf16) below kPairRowsX rows of x and two rows at a time from there; shorter rows,
// at one row of x, eight rows at a time (a reduction per row would cost as much as the row), and
// more rows of x take W four rows at a time (sixteen or twenty accumulators).
template <typename X, typename T, typename O, int NW>
void column_range(const X* xf, const T* w, const T* bias, O* out, int64_t M, int64_t N, int64_t K,
                  int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + NW <= end; n += NW) columns<X, T, O, NW>(xf, w, bias, out, M, N, K, n);
  for (; n < end; ++n) columns<X, T, O, 1>(xf, w, bias, out, M, N, K, n);
}

// The vdpbf16ps path's long rows from kPairRowsX rows of x: in panels of kColumnsPerTask columns (the
// panel's rows of W stay in L2), three rows of x at a time (in L1) against each pair of the panel's
// rows of W in turn, so that the x vectors come from L1 and only W's from L2.
template <typename X, typename T, typename O>
void column_range_rows_outer(const X* xf, const T* w, const T* bias, O* out, int64_t M, int64_t N, int64_t K,
                             int64_t begin, int64_t end) {
  for (int64_t p0 = begin; p0 < end; p0 += kColumnsPerTask) {
    const int64_t p1 = std::min(end, p0 + kColumnsPerTask);
    for (int64_t m0 = 0, mx; m0 < M; m0 += mx) {
      mx = std::min<int64_t>(3, M - m0);
      int64_t n = p0;
      for (; n + 2 <= p1; n += 2) columns<X, T, O, 2>(xf + m0 * K, w, bias, out + m0 * N, mx, N, K, n);
      for (; n < p1; ++n) columns<X, T, O, 1>(xf + m0 * K, w, bias, out + m0 * N, mx, N, K, n);
    }
  }
}

template <typename X, typename T, typename O>
void products(const X* xf, const T* w, const T* bias, O* out, int64_t M, int64_t N, int64_t K, int num_threads) {
  constexpr bool dp = !std::is_same_v<X, float>;
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
  for (int64_t m0 = 0; m0 < M; m0 += kRowsPerBlock) {  // a block of x stays in L2 while W streams by
    const int64_t mb = std::min(kRowsPerBlock, M - m0);
    const X* xb = xf + m0 * K;
    O* ob = out + m0 * N;
    const auto task_range = [&](int64_t begin, int64_t end) {
      if (dp && K >= kRowStreamK && mb >= kPairRowsX)
        column_range_rows_outer<X, T, O>(xb, w, bias, ob, mb, N, K, begin, end);
      else if (dp && K >= kRowStreamK)
        column_range<X, T, O, 1>(xb, w, bias, ob, mb, N, K, begin, end);
      else if (mb == 1)
        column_range<X, T, O, dp ? 8 : 4>(xb, w, bias, ob, mb, N, K, begin, end);
      else
        column_range<X, T, O, dp ? 4 : 2>(xb, w, bias, ob, mb, N, K, begin, end);
    };
    if (num_threads <= 1 || mb * N * K < kParallelWork) {  // no OpenMP region to enter
      task_range(0, N);
      continue;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t task = 0; task < tasks; ++task)
      task_range(task * kColumnsPerTask, std::min(N, (task + 1) * kColumnsPerTask));
  }
}

template <typename T, typename O>
void linear(const T* x, const T* w, const T* bias, O* out, int64_t M, int64_t N, int64_t K, int num_threads) {
  if constexpr (std::is_same_v<T, float> || kDotBf16) {  // x as it is: fp32, or bf16 for vdpbf16ps
    products(x, w, bias, out, M, N, K, num_threads);
  } else {  // bf16 x widened to fp32 once
    std::vector<float> widened(static_cast<size_t>(M * K));
    for (int64_t i = 0; i < M * K; ++i) widened[i] = to_float(x[i]);
    products(widened.data(), w, bias, out, M, N, K, num_threads);
  }
}

}  // namespace

extern "C" {

// out = x w^T + bias (bias may be null) for x [M, K], w [N, K]; any M, each row's outputs the same
// bits whatever M (see the invariant above).
void nanoserve_linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t M, int64_t N,
                          int64_t K, int num_threads) {
  linear(x, w, bias, out, M, N, K, num_threads);
}
void nanoserve_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t M,
                           int64_t N, int64_t K, int num_threads) {
  linear(x, w, bias, out, M, N, K, num_threads);
}
// The same products with the fp32 sums written as they are (no rounding to bf16): the LM head.
void nanoserve_linear_bf16_out_f32(const uint16_t* x, const uint16_t* w, const uint16_t* bias, float* out, int64_t M,
                                   int64_t N, int64_t K, int num_threads) {
  linear(x, w, bias, out, M, N, K, num_threads);
}

// 1 when the bf16 products use the AVX512-BF16 dot product (the library was built for a CPU with it).
int nanoserve_linear_bf16_native() { return kDotBf16 ? 1 : 0; }

}  // extern "C"
