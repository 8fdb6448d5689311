// Which path the quantized products take, chosen at compile time from the instruction set flags
// (-march=native, or the older ISA a test builds for), and the vector types and operations that
// quant_blocks.h and quant_dot.h are written in, so that each is written once for every path.
//
// Private to the products' translation units (included by quant.cpp, moe.cpp and the other quant_*.h
// only; see quant.cpp for the files' roles). Everything is in the unnamed namespace: internal linkage
// in each translation unit, so the compiler inlines and specialises as within a single file.
//
// The paths (kIsa, which nanoserve_quant_isa reports):
//   3  AVX512-VNNI with BW and DQ: 512-bit vectors (IV, FV) of two 32-value chunks, vpdpbusd;
//      NANOSERVE_QUANT_ZMM is defined (the k-quant groups unpack two chunks at once).
//   2  AVX-VNNI, or AVX512-VNNI with VL only: 256-bit vectors of one chunk, vpdpbusd's 256-bit form.
//   1  plain AVX2: 256-bit vectors, vpmaddubsw + vpmaddwd; kSignTrick (q8_0 takes llama.cpp's sign
//      form: its u = q + 128 would saturate vpmaddubsw).
//   0  no AVX2: no vector type here; quant.cpp's scalar products.
// Invariant: exactly one path per build, and the operations below mean the same on each (dot4:
// acc + the four-byte sums of u (unsigned) times s (signed), per int32 lane; maddubs: the pairs of
// u (unsigned) times s (signed) summed into int16 lanes, saturating; dot2: acc + the pairs of int16
// products summed, per int32 lane; the *32 operations per int32 lane, wrapping).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "simd.h"

namespace {

using namespace nanoserve;

#if defined(__AVX2__)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define NANOSERVE_QUANT_ZMM 1  // the k-quant groups unpack two chunks at once (uv, sv)
constexpr int kIsa = 3;
constexpr bool kSignTrick = false;
typedef __m512i IV;  // 64 bytes: two chunks
typedef __m512 FV;   // their 16 lane sums, as fp32
constexpr int64_t kVecValues = 64;
inline IV join(__m256i a, __m256i b) { return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1); }
inline FV join(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }
inline IV dot4(IV acc, IV u, IV s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline IV load_i(const void* p) { return _mm512_loadu_si512(p); }
inline FV load_f(const float* p) { return _mm512_loadu_ps(p); }
inline FV fzero() { return _mm512_setzero_ps(); }
inline FV fma(FV a, FV b, FV c) { return _mm512_fmadd_ps(a, b, c); }
inline FV mul(FV a, FV b) { return _mm512_mul_ps(a, b); }
inline FV add(FV a, FV b) { return _mm512_add_ps(a, b); }
inline FV to_fp32(IV a) { return _mm512_cvtepi32_ps(a); }
inline IV sign_mul(IV, IV) { return IV{}; }  // unused: kSignTrick is false
inline IV abs8(IV a) { return a; }
inline IV izero() { return _mm512_setzero_si512(); }
inline FV fset1(float v) { return _mm512_set1_ps(v); }
inline IV maddubs(IV u, IV s) { return _mm512_maddubs_epi16(u, s); }
inline IV dot2(IV acc, IV a, IV b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline IV iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline IV add32(IV a, IV b) { return _mm512_add_epi32(a, b); }
inline IV sub32(IV a, IV b) { return _mm512_sub_epi32(a, b); }
inline IV mullo32(IV a, IV b) { return _mm512_mullo_epi32(a, b); }
inline IV slli32(IV a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
inline void store_f(float* p, FV v) { _mm512_storeu_ps(p, v); }

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
// The superblock_int formats' products of many rows of x may take AMX-INT8 tiles (quant_amx.h), on
// a CPU that has them, once this process may use them.
#define NANOSERVE_AMX 1
// Whether this process may use AMX-INT8 tiles: the CPU has them (CPUID leaf 7: AMX-TILE, AMX-INT8),
// the OS saves their state (XCR0 bits 17 and 18) and grants this process their use (Linux 5.16's
// ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once; granted for every thread of the process).
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || (c & bit_OSXSAVE) == 0) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
    if ((_xgetbv(0) & 0x60000) != 0x60000) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return usable;
}
#endif

#else
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr int kIsa = 2;
constexpr bool kSignTrick = false;
#else
constexpr int kIsa = 1;
constexpr bool kSignTrick = true;
#endif
typedef __m256i IV;  // 32 bytes: one chunk
typedef __m256 FV;
constexpr int64_t kVecValues = 32;
inline IV join(__m256i a, __m256i) { return a; }
inline FV join(__m256 a, __m256) { return a; }
inline IV dot4(IV acc, IV u, IV s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline IV load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline FV load_f(const float* p) { return _mm256_loadu_ps(p); }
inline FV fzero() { return _mm256_setzero_ps(); }
inline FV fma(FV a, FV b, FV c) { return _mm256_fmadd_ps(a, b, c); }
inline FV mul(FV a, FV b) { return _mm256_mul_ps(a, b); }
inline FV add(FV a, FV b) { return _mm256_add_ps(a, b); }
inline FV to_fp32(IV a) { return _mm256_cvtepi32_ps(a); }
inline IV sign_mul(IV w, IV x) { return _mm256_sign_epi8(w, x); }  // w * sign(x), lane by lane
inline IV abs8(IV a) { return _mm256_abs_epi8(a); }
inline IV izero() { return _mm256_setzero_si256(); }
inline FV fset1(float v) { return _mm256_set1_ps(v); }
inline IV maddubs(IV u, IV s) { return _mm256_maddubs_epi16(u, s); }
inline IV iset1(int32_t v) { return _mm256_set1_epi32(v); }
inline IV add32(IV a, IV b) { return _mm256_add_epi32(a, b); }
inline IV sub32(IV a, IV b) { return _mm256_sub_epi32(a, b); }
inline IV mullo32(IV a, IV b) { return _mm256_mullo_epi32(a, b); }
inline IV slli32(IV a, int n) { return _mm256_slli_epi32(a, n); }
inline void store_f(float* p, FV v) { _mm256_storeu_ps(p, v); }
inline IV dot2(IV acc, IV a, IV b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

#else  // no AVX2

constexpr int kIsa = 0;

#endif

#if !defined(NANOSERVE_AMX)
inline bool amx_usable() { return false; }
#endif

}  // namespace
