// The AMX path of the quantized products: bf16 products of many rows of x, W dequantized 32 rows at
// a time into AMX tiles. Only where the build has AMX (NANOSERVE_QUANT_AMX, quant_isa.h); quant.cpp
// sends bf16 x of kAmxRows rows or more here when the OS grants the tile state (amx_permitted).
//
// Private to quant.cpp's translation unit (included by quant.cpp and the other quant_*.h only; see
// quant.cpp for the files' roles). Everything is in the unnamed namespace: internal linkage in that
// one translation unit, so the compiler inlines and specialises as within a single file.
//
// For bf16 x, each task dequantizes 32 rows of W to bf16 (dequantize_row: in L2 while it is used)
// and multiplies them with all of x in AMX tiles: rows of W as A tiles (16 rows x 32 values, straight
// from the dequantized rows), x as B tiles (AMX's pair layout, packed once per call), fp32 sums in
// four C tiles (2 x 2 tiles of 16 x 16) across all of K. Against dequantized tiles handed to torch's
// GEMM (the path without AMX) this skips the GEMM's packing of W and the dequantized tile's round trip
// through memory; against the int8 dot products it multiplies many rows of x at AMX's rate.
//
// Invariants: no activation is quantized here: each output is x times W rounded to bf16, summed in
// fp32 and rounded to bf16 once; the tile configuration is loaded and released by each OpenMP
// thread within amx_products.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

#if defined(NANOSERVE_QUANT_AMX)

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kAmxRows = 10;  // rows of x from which the products take the AMX path

// Linux hands AMX's tile state only to a process that asks for it (asking again is a no-op).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                        18 /* XFEATURE_XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: 0, 1 rows of W (16 x 32 bf16); 2, 3 x (16 pairs x 16 rows of x);
// 4-7 the sums (16 columns of W x 16 rows of x, fp32) of (0, 2), (0, 3), (1, 2), (1, 3).
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// The 16 x 16 matrix in r (r[i] its row i) transposed in place. Two rounds of unpacks leave, in each
// 128-bit lane L of u[4k + j], column 4L + j of rows 4k .. 4k + 3; a 4 x 4 transpose of those lanes
// across u[j], u[4 + j], u[8 + j], u[12 + j] then gathers each column's four lanes.
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int k = 0; k < 16; k += 4)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[k + h]), b = _mm512_castps_pd(t[k + h + 2]);
      u[k + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      u[k + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int j = 0; j < 4; ++j) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee);
    const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
    r[8 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
  }
}

// x [M, K] bf16 in B tiles: tile (i, c) (rows 16i .. 16i + 15 of x, values 32c .. 32c + 31) at
// 512 (i * K / 32 + c), its row r the pairs x[m][32c + 2r], x[m][32c + 2r + 1] of its 16 rows m side
// by side (a 16 x 16 transpose of 32-bit pairs); rows past M zero.
inline std::vector<uint16_t> pair_tiles(const uint16_t* x, int64_t M, int64_t Mp, int64_t K) {
  std::vector<uint16_t> b(Mp * K);
  for (int64_t m0 = 0; m0 < Mp; m0 += 16)
    for (int64_t k = 0; k < K; k += 32) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_loadu_ps(x + (m0 + i) * K + k) : _mm512_setzero_ps();
      transpose16(r);
      uint16_t* tile = b.data() + ((m0 / 16) * (K / 32) + k / 32) * 512;
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(tile + 32 * i, r[i]);
    }
  return b;
}

// out columns [0, N16) (N16 a multiple of 16) for all M rows of bf16 x, K a multiple of 32.
template <int Q>
void amx_products(const uint16_t* x, const uint8_t* w, int64_t row_bytes, const uint16_t* bias, uint16_t* out,
                  int64_t out_stride, int64_t M, int64_t N16, int64_t K, int num_threads) {
  const int64_t Mp = (M + 15) / 16 * 16, chunks = K / 32;
  const std::vector<uint16_t> xb = pair_tiles(x, M, Mp, K);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    configure_tiles();
    std::vector<uint16_t> rows(32 * K);  // [2][chunks][16][32]: W's tiles, each 1 KB contiguous
    alignas(64) float sums[4][16][16];
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N16; n0 += 32) {
      const bool two_n = n0 + 16 < N16;
      for (int64_t r = 0; r < (two_n ? 32 : 16); ++r) {
        // Row r of the next 32 meanwhile (the next task's where one thread runs them all; a prefetch
        // never faults).
        for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(w + (n0 + 32 + r) * row_bytes + at, 0, 2);
        dequantize_row<Q>(w + (n0 + r) * row_bytes, K, rows.data() + (r / 16) * 16 * K + (r % 16) * 32, 512);
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const bool two_m = m0 + 16 < Mp;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        const uint16_t* x0 = xb.data() + (m0 / 16) * chunks * 512;
        for (int64_t c = 0; c < chunks; ++c) {  // the tile numbers are literals in the intrinsics
          _tile_loadd(0, rows.data() + 512 * c, 64);
          _tile_loadd(2, x0 + c * 512, 64);
          _tile_dpbf16ps(4, 0, 2);
          if (two_m) {
            _tile_loadd(3, x0 + (chunks + c) * 512, 64);
            _tile_dpbf16ps(5, 0, 3);
          }
          if (two_n) {
            _tile_loadd(1, rows.data() + 16 * K + 512 * c, 64);
            _tile_dpbf16ps(6, 1, 2);
            if (two_m) _tile_dpbf16ps(7, 1, 3);
          }
        }
        _tile_stored(4, sums[0], 64);
        _tile_stored(5, sums[1], 64);
        _tile_stored(6, sums[2], 64);
        _tile_stored(7, sums[3], 64);
        for (int t = 0; t < 4; ++t) {
          const int64_t n = n0 + 16 * (t / 2), m = m0 + 16 * (t % 2);
          if (n >= N16 || m >= M) continue;
          __m512 cols[16];  // cols[i]: row m + i of x against columns n .. n + 15
          for (int j = 0; j < 16; ++j) cols[j] = _mm512_load_ps(sums[t][j]);
          transpose16(cols);
          const __m512 b = bias != nullptr ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n))), 16))
                                           : _mm512_setzero_ps();
          for (int64_t i = 0; i < std::min<int64_t>(16, M - m); ++i)
            store16(_mm512_add_ps(cols[i], b), out + (m + i) * out_stride + n);
        }
      }
    }
    _tile_release();
  }
}

}  // namespace

#endif
