// y = x W^T (+ b) with W in GGUF's block formats (q8_0, q4_0, q4_k, q5_k, q6_k), kept quantized,
// and the rows of such a W dequantized (embedding gathers, tiles for a bf16 product).
//
// Part of the CPU kernel library that nanoserve/native.py builds at first use (see there).
//
// W layout: [N rows, row_bytes] row-major, each row its blocks side by side, byte for byte as a
// GGUF tensor (nanoserve/model/block_quant.py spells the block layouts out). Every weight value is
// scale * (u - offset) - min with u a small unsigned integer: q8_0 u = q + 128 (offset 128), q4_0 a
// nibble (offset 8), q6_k six bits (offset 32), q4_k / q5_k four or five bits (offset 0, a min per
// 32 values); the scale is per 32 values (q6_k: per 16).
//
// Activations are quantized per product, row by row, in blocks of 32: dx = max|x| / 127, qx =
// round(x / dx) in [-127, 127]. A 32-value stretch ("chunk") of a row of W then contributes
//   sum_i w_i x_i ~= dx * (scale * (sum_i u_i qx_i - offset * sum_i qx_i) - min * sum_i qx_i)
// where the integer sums are exact. llama.cpp quantizes activations for its k-quants in blocks of
// 256 (one scale) and multiplies the sub-block scales in as integers; here every 4-value lane's
// int32 sum goes through one fp32 multiply-add with its (W scale * x scale) anyway, so blocks of 32
// cost nothing more and keep the activations more precise. Per activation row we keep: qx (int8),
// the scale of each 4-value lane (fp32), -offset * (the lane's sum of qx) (int32: the dot product
// instruction starts from it, so the offset costs no instruction) and dx * sum(qx) per chunk (for
// the mins).
//
// The dot products: with AVX512-VNNI, vpdpbusd multiplies 64 unsigned bytes of W by 64 signed
// bytes of x and adds each group of four into 16 int32 lanes (two chunks per instruction); with
// AVX-VNNI its 256-bit form (one chunk); on plain AVX2, vpmaddubsw (u8 x s8 -> pairs summed to
// int16) then vpmaddwd by ones (-> int32). vpmaddubsw saturates at 2^15 - 1, which u <= 63 never
// reaches but q8_0's u = q + 128 would, so q8_0 on plain AVX2 takes the form llama.cpp uses:
// |qx| against q * sign(qx), no offset (this needs q8_0 quants in [-127, 127], as ggml's quantizers
// write them; -128 would flip wrongly). Each lane's int32 is converted to fp32 and multiplied by
// its two scales into an fp32 accumulator per (row of W, row of x). Without AVX2 a plain scalar
// loop dequantizes each block of W and multiplies it with x in fp32 (no activation quantization).
// The path is chosen at compile time (-march=native): nanoserve_quant_isa reports which.
//
// Structure (as linear.cpp): output columns shared among OpenMP threads in tasks of 64 rows of W;
// in a task, W's rows in groups of NW (four for one row of x, two for more) against the rows of x in
// groups of up to eight; each group of W's blocks is unpacked into registers once per group of x
// rows and read from L1 for the next, so W streams from memory once per call (the next group of
// rows prefetched meanwhile). One row of x against q8_0 W (single-stream decode of a Q8_0 file)
// takes its own loop where the CPU has AVX512-VNNI (q8_0_dot4), which shares the per-block work
// among four rows. These products are for a few dozen rows of x at most: on CPUs with AMX, bf16 x
// of kAmxRows rows or more goes to AMX tiles of W dequantized (amx_products, below);
// elsewhere, where a GEMM on bf16 / fp32 is much faster per multiply-add than the int8 lanes here,
// CpuLayerOps multiplies tiles of W dequantized by dequantize_rows instead (see
// nanoserve/model/layer_ops.py for the cut).
//
// Layouts: x [M, K] contiguous; bias [N] or null (x's type); out row m at out + m * out_stride
// (out_stride >= N: a fused matrix's parts write column slices of one output).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"
#include "simd.h"

namespace {

using namespace nanoserve;

// GGUF's tensor type ids (GGMLQuantizationType).
constexpr int kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kChunk = 32;             // values per activation block and per lane-scale group of W
constexpr int64_t kColumnsPerTask = 64;    // output columns per OpenMP work item
constexpr int kRowsX = 8;                  // rows of x per pass over a group of W's rows, at most
constexpr int64_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all

struct BlockLayout {
  int64_t values, bytes;
};

// Values and bytes per block; {0, 0} for a type this file does not take.
constexpr BlockLayout layout(int qtype) {
  switch (qtype) {
    case kQ8_0: return {32, 34};
    case kQ4_0: return {32, 18};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float fp16(const uint8_t* p) {  // IEEE half at p (little-endian) as a float
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The eight 6-bit scales and mins of a q4_k / q5_k block's 12 scale bytes (see block_quant.py),
// a byte each: scale c in byte c of *scales, min c in byte c of *mins. Bytes 0-3 hold scales 0-3,
// bytes 4-7 mins 0-3 (low 6 bits each); scale / min 4 + i is the low / high nibble of byte 8 + i
// topped by the top two bits of byte i / 4 + i. Done on 32-bit words, four bytes at once.
inline void k_scales(const uint8_t* p, uint64_t* scales, uint64_t* mins) {
  uint32_t w[3];
  std::memcpy(w, p, sizeof w);
  const uint32_t scales_lo = w[0] & 0x3f3f3f3fu, mins_lo = w[1] & 0x3f3f3f3fu;
  const uint32_t scales_hi = (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u);
  const uint32_t mins_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u);
  *scales = scales_lo | static_cast<uint64_t>(scales_hi) << 32;
  *mins = mins_lo | static_cast<uint64_t>(mins_hi) << 32;
}

// One block at p as floats y[0 .. values): each value as ggml computes it, (d * scale) * q - dmin * min.
void dequantize_block(int qtype, const uint8_t* p, float* y) {
  switch (qtype) {
    case kQ8_0: {
      const float d = fp16(p);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
      break;
    }
    case kQ4_0: {
      const float d = fp16(p);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * static_cast<float>((p[2 + i] & 0xf) - 8);
        y[i + 16] = d * static_cast<float>((p[2 + i] >> 4) - 8);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool five = qtype == kQ5_K;
      const float d = fp16(p), dmin = fp16(p + 2);
      uint64_t sc, mn;  // byte c: chunk c's scale, min
      k_scales(p + 4, &sc, &mn);
      const uint8_t* qh = p + 16;
      const uint8_t* qs = p + (five ? 48 : 16);
      for (int c = 0; c < 8; ++c) {
        const float d1 = d * static_cast<float>((sc >> (8 * c)) & 0xff);
        const float m1 = dmin * static_cast<float>((mn >> (8 * c)) & 0xff);
        for (int l = 0; l < 32; ++l) {
          int q = c % 2 == 0 ? qs[32 * (c / 2) + l] & 0xf : qs[32 * (c / 2) + l] >> 4;
          if (five) q |= ((qh[l] >> c) & 1) << 4;
          y[32 * c + l] = d1 * static_cast<float>(q) - m1;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = fp16(p + 208);
      for (int c = 0; c < 8; ++c) {  // chunk c: half c / 4, group g = c % 4 of that half
        const int h = c / 4, g = c % 4;
        const uint8_t* ql = p + 64 * h + 32 * (g % 2);
        const uint8_t* qh = p + 128 + 32 * h;
        for (int l = 0; l < 32; ++l) {
          const int low = g < 2 ? ql[l] & 0xf : ql[l] >> 4;
          const int q = (low | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
          const float d1 = d * static_cast<float>(static_cast<int8_t>(p[192 + 2 * c + l / 16]));
          y[32 * c + l] = d1 * static_cast<float>(q);
        }
      }
      break;
    }
    default: break;
  }
}

// One row of W [K] as floats, block by block (the SIMD path has its own, same values).
inline void dequantize_row_scalar(int qtype, const uint8_t* src, int64_t K, float* y) {
  const BlockLayout b = layout(qtype);
  for (int64_t blk = 0; blk < K / b.values; ++blk) dequantize_block(qtype, src + blk * b.bytes, y + blk * b.values);
}

#if defined(__AVX2__)

// --- The SIMD path: chunks of 32 values of a row of W as 32 unsigned bytes and 8 lane scales.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define NANOSERVE_QUANT_ZMM 1  // the k-quant groups unpack two chunks at once (uv, sv)
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#define NANOSERVE_QUANT_AMX 1  // products of many rows of x in AMX tiles
constexpr int64_t kAmxRows = 10;  // rows of x from which they take the AMX path
#endif
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
inline FV to_fp32(IV a) { return _mm512_cvtepi32_ps(a); }
inline float reduce(FV a) { return _mm512_reduce_add_ps(a); }
inline IV sign_mul(IV, IV) { return IV{}; }  // unused: kSignTrick is false
inline IV abs8(IV a) { return a; }
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
inline FV to_fp32(IV a) { return _mm256_cvtepi32_ps(a); }
inline float reduce(FV a) {
  vec8 v;
  std::memcpy(&v, &a, sizeof v);
  return hsum(v);
}
inline IV sign_mul(IV w, IV x) { return _mm256_sign_epi8(w, x); }  // w * sign(x), lane by lane
inline IV abs8(IV a) { return _mm256_abs_epi8(a); }
#endif
constexpr int64_t kChunksPerVec = kVecValues / kChunk;

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }
inline __m256 lanes_of(__m256 v, int i) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i)); }

// The offset each format's u carries (folded into the activation rows) and whether it has mins.
constexpr int offset_of(int qtype) {
  return qtype == kQ8_0 ? (kSignTrick ? 0 : 128) : qtype == kQ4_0 ? 8 : qtype == kQ6_K ? 32 : 0;
}
constexpr bool has_mins(int qtype) { return qtype == kQ4_K || qtype == kQ5_K; }

// One group of W's blocks, decoded: `values` values, from which chunk(c) gives chunk c's unsigned
// bytes and lane scales, and (k-quants with mins) `mins` the min of each chunk.
template <int Q>
struct Group;

#if defined(NANOSERVE_QUANT_ZMM)
// The lane scales of a vector of two 32-value blocks whose fp16 scale is their first two bytes: d of
// the block at a in lanes 0-7, of the block at b (null: 0) in lanes 8-15; one conversion for both.
inline FV scales_of_two(const uint8_t* a, const uint8_t* b) {
  uint16_t da, db = 0;
  std::memcpy(&da, a, sizeof da);
  if (b != nullptr) std::memcpy(&db, b, sizeof db);
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(da | static_cast<uint32_t>(db) << 16)));
  return _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1),
                               _mm512_castps128_ps512(both));
}
#endif

template <>
struct Group<kQ8_0> {  // one block
  static constexpr int64_t values = 32;
  const uint8_t* p;
  __m256 scale;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block), scale(_mm256_set1_ps(fp16(block))) {}
  __m256i u(int) const {
    const __m256i q = load32(p + 2);
    return kSignTrick ? q : _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
#if defined(NANOSERVE_QUANT_ZMM)  // a vector is two blocks: this one at a, the next at b (null: none)
  static FV pair_scales(const uint8_t* a, const uint8_t* b) { return scales_of_two(a, b); }
#else  // a vector is this one block
  IV uv(int) const { return u(0); }
  FV sv(int) const { return scale; }
#endif
};

template <>
struct Group<kQ4_0> {  // one block
  static constexpr int64_t values = 32;
  const uint8_t* p;
  __m256 scale;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block), scale(_mm256_set1_ps(fp16(block))) {}
  __m256i u(int) const {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
  }
#if defined(NANOSERVE_QUANT_ZMM)  // a vector is two blocks: this one at a, the next at b (null: none)
  static FV pair_scales(const uint8_t* a, const uint8_t* b) { return scales_of_two(a, b); }
#else  // a vector is this one block
  IV uv(int) const { return u(0); }
  FV sv(int) const { return scale; }
#endif
};

// q4_k and q5_k: scales d * sc[c] and mins dmin * mn[c] per chunk c, in lanes 0-7 and 8-15 of
// `both` (512-bit vectors) or in `scale8` and `min8`. min_lanes() holds the mins in the lanes where
// place_sums puts the activation's chunk sums (the rest zero there).
template <int Q>
struct KGroup {
  static constexpr int64_t values = 256;
  const uint8_t* p;
#if defined(NANOSERVE_QUANT_ZMM)
  __m512 both;
  KGroup() = default;
  explicit KGroup(const uint8_t* block) : p(block) {
    uint64_t sc, mn;
    k_scales(block + 4, &sc, &mn);
    const __m512 ints = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_set_epi64x(static_cast<int64_t>(mn), static_cast<int64_t>(sc))));
    uint32_t d_dmin;
    std::memcpy(&d_dmin, block, sizeof d_dmin);
    const __m512 factors = _mm512_permutexvar_ps(  // d in lanes 0-7, dmin in 8-15
        _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1),
        _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d_dmin)))));
    both = _mm512_mul_ps(factors, ints);
  }
  __m256 scales() const { return _mm512_castps512_ps256(both); }
  FV min_lanes() const { return both; }
  static FV place_sums(__m256 sums) { return _mm512_insertf32x8(_mm512_setzero_ps(), sums, 1); }
#else
  __m256 scale8, min8;
  KGroup() = default;
  explicit KGroup(const uint8_t* block) : p(block) {
    uint64_t sc, mn;
    k_scales(block + 4, &sc, &mn);
    scale8 = _mm256_mul_ps(_mm256_set1_ps(fp16(block)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc)))));
    min8 = _mm256_mul_ps(_mm256_set1_ps(fp16(block + 2)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn)))));
  }
  __m256 scales() const { return scale8; }
  FV min_lanes() const { return min8; }
  static FV place_sums(__m256 sums) { return sums; }
#endif
  __m256i u(int c) const {
    constexpr int64_t qs = Q == kQ5_K ? 48 : 16;
    const __m256i q = load32(p + qs + 32 * (c / 2));
    const __m256i n = c % 2 == 0 ? low_nibbles(q) : high_nibbles(q);
    if constexpr (Q == kQ5_K) {
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(load32(p + 16), _mm_cvtsi32_si128(c)),
                                           _mm256_set1_epi8(1));
      return _mm256_or_si256(n, _mm256_slli_epi16(bit, 4));
    }
    return n;
  }
  __m256 s(int c) const { return lanes_of(scales(), c); }
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const {  // chunks 2v (low nibbles) and 2v + 1 (high nibbles) of the same 32 bytes
    constexpr int64_t qs = Q == kQ5_K ? 48 : 16;
    const __m512i q = _mm512_broadcast_i64x4(load32(p + qs + 32 * v));
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i n = _mm512_and_si512(_mm512_srlv_epi16(q, halves), _mm512_set1_epi8(0x0f));
    if constexpr (Q == kQ5_K) {
      const __m512i shift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(2 * v))),
                                               _mm256_set1_epi16(static_cast<int16_t>(2 * v + 1)), 1);
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(p + 16)), shift),
                                           _mm512_set1_epi8(1));
      return _mm512_or_si512(n, _mm512_slli_epi16(bit, 4));
    }
    return n;
  }
  FV sv(int v) const {
    const __m512i lanes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * v)),
                                             _mm256_set1_epi32(2 * v + 1), 1);
    return _mm512_permutexvar_ps(lanes, both);
  }
#else
  IV uv(int v) const { return u(v); }
  FV sv(int v) const { return s(v); }
#endif
};
template <>
struct Group<kQ4_K> : KGroup<kQ4_K> {
  using KGroup::KGroup;
};
template <>
struct Group<kQ5_K> : KGroup<kQ5_K> {
  using KGroup::KGroup;
};

template <>
struct Group<kQ6_K> {  // scales d * sc[i], one per 16 values: chunk c's lanes 0-3 and 4-7 take 2c, 2c + 1
  static constexpr int64_t values = 256;
  const uint8_t* p;
#if defined(NANOSERVE_QUANT_ZMM)
  __m512 all;  // the 16 scales
  Group() = default;
  explicit Group(const uint8_t* block)
      : p(block),
        all(_mm512_mul_ps(_mm512_set1_ps(fp16(block + 208)),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)))))) {}
  __m256 half(int h) const { return h == 0 ? _mm512_castps512_ps256(all) : _mm512_extractf32x8_ps(all, 1); }
#else
  __m256 scales[2];
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {
    const __m256 d = _mm256_set1_ps(fp16(block + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    scales[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    scales[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  }
  __m256 half(int h) const { return scales[h]; }
#endif
  // Group g's two high bits (bits 2g, 2g + 1 of each qh byte) moved to bits 4-5 by one shift of the
  // 16-bit lanes, left by 4 - 2g or right by 2g - 4 (what crosses into the neighbouring byte lands
  // outside bits 4-5 there), then masked.
  static __m256i top_bits(__m256i qh, int g) {
    const __m256i moved = g < 2 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - 2 * g))
                                : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g - 4));
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x30));
  }
  __m256i u(int c) const {
    const int h = c / 4, g = c % 4;
    const __m256i ql = load32(p + 64 * h + 32 * (g % 2));
    const __m256i low = g < 2 ? low_nibbles(ql) : high_nibbles(ql);
    return _mm256_or_si256(low, top_bits(load32(p + 128 + 32 * h), g));
  }
  __m256 s(int c) const {
    const int i = 2 * (c % 4);
    return _mm256_permutevar8x32_ps(half(c / 4), _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1));
  }
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const {  // chunks 2v, 2v + 1: groups g, g + 1 of half v / 2 (g = 2 (v % 2)), ql runs 0 and 1
    // As top_bits for both groups at once (groups 0, 1: left by 4, 2; groups 2, 3: right by 0, 2), and
    // the nibbles and those bits merged by one vpternlogd: (low & 0x0f) | top.
    const int h = v / 2;
    const __m512i ql = _mm512_loadu_si512(p + 64 * h);
    const __m512i low = v % 2 == 0 ? ql : _mm512_srli_epi16(ql, 4);
    const __m512i qh = _mm512_broadcast_i64x4(load32(p + 128 + 32 * h));
    const __m512i by = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(v % 2 == 0 ? 4 : 0)),
                                          _mm256_set1_epi16(2), 1);
    const __m512i top = _mm512_and_si512(v % 2 == 0 ? _mm512_sllv_epi16(qh, by) : _mm512_srlv_epi16(qh, by),
                                         _mm512_set1_epi8(0x30));
    return _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(0x0f), 0xec);
  }
  FV sv(int v) const {  // lane l: scale 4v + l / 4
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * v),
                                           _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                               12, 13, 14, 15), 2));
    return _mm512_permutexvar_ps(lanes, all);
  }
#else
  IV uv(int v) const { return u(v); }
  FV sv(int v) const { return s(v); }
#endif
};

// Group Q's scales at block p as dequantize_block computes them: s[i] that of values 16i .. 16i + 15,
// mins[c] (k-quants with mins) the min of chunk c.
template <int Q>
inline void group_scales(const uint8_t* p, float* s, float* mins) {
  if constexpr (Q == kQ8_0 || Q == kQ4_0) {
    s[0] = s[1] = fp16(p);
  } else if constexpr (has_mins(Q)) {
    const float d = fp16(p), dmin = fp16(p + 2);
    uint64_t sc, mn;
    k_scales(p + 4, &sc, &mn);
    for (int c = 0; c < 8; ++c) {
      s[2 * c] = s[2 * c + 1] = d * static_cast<float>((sc >> (8 * c)) & 0xff);
      mins[c] = dmin * static_cast<float>((mn >> (8 * c)) & 0xff);
    }
  } else {  // q6_k: a scale per 16 values
    const float d = fp16(p + 208);
    for (int i = 0; i < 16; ++i) s[i] = d * static_cast<float>(static_cast<int8_t>(p[192 + i]));
  }
}

// 16 values s * (u - offset) - min (min only `with_min`) of 16 bytes u (unsigned; signed where
// `signed_u`) as fp32: a multiply, then a subtraction, as dequantize_block computes them.
#if defined(NANOSERVE_QUANT_ZMM)
template <bool signed_u, bool with_min>
inline __m512 values16(__m128i u, int offset, float s, float min) {
  const __m512i wide = signed_u ? _mm512_cvtepi8_epi32(u) : _mm512_cvtepu8_epi32(u);
  __m512 v = _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_sub_epi32(wide, _mm512_set1_epi32(offset))));
  if constexpr (with_min) v = _mm512_sub_ps(v, _mm512_set1_ps(min));
  return v;
}

inline void store16(__m512 v, float* dst) { _mm512_storeu_ps(dst, v); }
inline void store16(__m512 v, uint16_t* dst) {  // from_float, lane by lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i out = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(out));
}

// A chunk's 32 values (lo: 0-15, hi: 16-31) as T at dst. For bf16 with AVX512-BF16 one vcvtne2ps2bf16
// rounds both halves: to nearest even as from_float, the same bits for every value a block holds
// (dequantized values are zero or normal floats; a NaN scale gives a NaN either way).
template <typename T>
inline void store32(__m512 lo, __m512 hi, T* dst) {
#if defined(__AVX512BF16__)
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    return;
  }
#endif
  store16(lo, dst);
  store16(hi, dst + 16);
}
#endif

// A chunk of 32 bytes u as T at dst: s_lo, s_hi the scales of values 0-15 and 16-31.
template <bool signed_u, bool with_min, typename T>
inline void dequantize_chunk(__m256i u, int offset, float s_lo, float s_hi, float min, T* dst) {
#if defined(NANOSERVE_QUANT_ZMM)
  store32(values16<signed_u, with_min>(_mm256_castsi256_si128(u), offset, s_lo, min),
          values16<signed_u, with_min>(_mm256_extracti128_si256(u, 1), offset, s_hi, min), dst);
#else
  for (int h = 0; h < 4; ++h) {
    const __m128i bytes = _mm_srli_si128(h < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1),
                                         8 * (h % 2));
    const __m256i wide = signed_u ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(h < 2 ? s_lo : s_hi),
                             _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, _mm256_set1_epi32(offset))));
    if constexpr (with_min) v = _mm256_sub_ps(v, _mm256_set1_ps(min));
    store8(v, dst + 8 * h);
  }
#endif
}

// One row of W [K] as T, chunk by chunk through the groups' unsigned bytes (q8_0: its signed quants
// as they are): value = s * (u - offset) - min, as dequantize_block computes it (so the same bits).
// Chunk c (values 32c .. 32c + 31) goes to y + c * chunk_stride (32: a contiguous row).
template <int Q, typename T>
void dequantize_row(const uint8_t* src, int64_t K, T* y, int64_t chunk_stride = kChunk) {
  using G = Group<Q>;
  constexpr int64_t chunks = G::values / kChunk;
  for (int64_t gi = 0; gi < K / G::values; ++gi) {
    const uint8_t* p = src + gi * layout(Q).bytes;
    float s[G::values / 16], mins[chunks] = {};
    group_scales<Q>(p, s, mins);
    T* out = y + gi * chunks * chunk_stride;
    if constexpr (Q == kQ8_0) {
      dequantize_chunk<true, false>(load32(p + 2), 0, s[0], s[1], 0.0f, out);
    } else {
      const G g(p);
      for (int c = 0; c < chunks; ++c)
        dequantize_chunk<false, has_mins(Q)>(g.u(c), offset_of(Q), s[2 * c], s[2 * c + 1], mins[c],
                                             out + c * chunk_stride);
    }
  }
}

template <typename T>
inline void dequantize_row_any(int qtype, const uint8_t* src, int64_t K, T* y) {
  switch (qtype) {
    case kQ8_0: dequantize_row<kQ8_0>(src, K, y); break;
    case kQ4_0: dequantize_row<kQ4_0>(src, K, y); break;
    case kQ4_K: dequantize_row<kQ4_K>(src, K, y); break;
    case kQ5_K: dequantize_row<kQ5_K>(src, K, y); break;
    case kQ6_K: dequantize_row<kQ6_K>(src, K, y); break;
    default: break;
  }
}

// The activation rows of one product, quantized for format Q (see the header), K padded with zeros
// to Kp, a multiple of the vector and of the group.
struct Activations {
  int64_t Kp;
  std::vector<int8_t> q;      // [M, Kp]
  std::vector<float> scale;   // [M, Kp / 4]: each lane's dx
  std::vector<int32_t> base;  // [M, Kp / 4]: -offset * the lane's sum of qx
  std::vector<float> sums;    // [M, Kp / 32]: dx * the chunk's sum of qx
};

template <typename T>
void quantize_activations(const T* x, int64_t M, int64_t K, int64_t Kp, int offset, Activations& a) {
  a.Kp = Kp;
  a.q.assign(M * Kp, 0);
  a.scale.assign(M * Kp / 4, 0.0f);
  a.base.assign(M * Kp / 4, 0);
  a.sums.assign(M * Kp / kChunk, 0.0f);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K / kChunk; ++c) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = static_cast<__m256>(load8(x + m * K + c * kChunk + 8 * i));
      const __m256 amax8 = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                         _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
      __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
      amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
      const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
      // round(x / dx) to nearest even (vcvtps2dq, as lrintf in the default rounding mode), then
      // narrowed to bytes in order (the packs interleave 128-bit halves; the permute undoes it).
      __m256i q32[4];
      for (int i = 0; i < 4; ++i) q32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
      const __m256i q16 = _mm256_packs_epi32(q32[0], q32[1]), q16b = _mm256_packs_epi32(q32[2], q32[3]);
      const __m256i q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      const int64_t at = m * Kp + c * kChunk;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + at), q);
      // Each 4-value lane's sum of qx: bytes times one, pairs summed to int16, then to int32.
      const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
      _mm256_storeu_ps(a.scale.data() + at / 4, _mm256_set1_ps(d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.base.data() + at / 4),
                          _mm256_mullo_epi32(lanes, _mm256_set1_epi32(-offset)));
      __m128i total = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
      total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4e));
      total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xb1));
      a.sums[at / kChunk] = d * static_cast<float>(_mm_cvtsi128_si32(total));
    }
}

// res[m][j] = x_m . w_j for MX activation rows (from row m0) and NW rows of W (from w, row_bytes apart).
template <int Q, int NW, int MX>
void dot_block(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t m0, int64_t K,
               float (*res)[4]) {
  static_assert(MX <= kRowsX && NW <= 4, "res holds kRowsX rows of 4 columns");
  using G = Group<Q>;
  constexpr int64_t bytes = layout(Q).bytes;
  FV acc[NW][MX];
  for (int j = 0; j < NW; ++j)
    for (int m = 0; m < MX; ++m) acc[j][m] = fzero();
  const int64_t Kp = a.Kp;
  // A step covers max(one group, one vector) of values: two q8_0 / q4_0 blocks per 512-bit vector.
  constexpr int64_t per_step = std::max<int64_t>(G::values, kVecValues);
  constexpr int64_t groups_per_step = per_step / G::values;
  const int64_t num_groups = K / G::values;
  for (int64_t k = 0; k < K; k += per_step) {
    const int64_t g0 = k / G::values;
    // The second group of a step may lie past K (an odd number of 32-value blocks): zero chunks,
    // against zero-padded activations.
    const bool pair = groups_per_step == 2 && g0 + 1 < num_groups;
    // The same stretch of the next NW rows of W (the next call's, or the next task's: rows follow
    // one another in memory), a cache line at a time: the hardware prefetcher does not run far
    // enough ahead on NW interleaved streams, so W would otherwise arrive at a fraction of the rate
    // memory delivers it. Into all cache levels (a prefetch never faults).
    for (int j = NW; j < 2 * NW; ++j)
      for (int64_t at = g0 * bytes; at < (g0 + groups_per_step) * bytes; at += 64)
        __builtin_prefetch(w + j * row_bytes + at, 0, 3);
    G ga[NW], gb[NW];
    for (int j = 0; j < NW; ++j) {
      ga[j] = G(w + j * row_bytes + g0 * bytes);
      if (pair) gb[j] = G(w + j * row_bytes + (g0 + 1) * bytes);
    }
    // Unrolled: each vector's offsets and lanes are then constants, with no address or index
    // arithmetic per vector.
#pragma GCC unroll 8
    for (int64_t v = 0; v < per_step / kVecValues; ++v) {
      IV u[NW];
      FV s[NW];
      for (int j = 0; j < NW; ++j) {
        if constexpr (groups_per_step == 1) {
          u[j] = ga[j].uv(static_cast<int>(v));
          s[j] = ga[j].sv(static_cast<int>(v));
        } else {  // two one-chunk groups in one vector
          const uint8_t* row = w + j * row_bytes + g0 * bytes;
          u[j] = join(ga[j].u(0), pair ? gb[j].u(0) : _mm256_setzero_si256());
          s[j] = G::pair_scales(row, pair ? row + bytes : nullptr);
        }
      }
      const int64_t at = k + v * kVecValues;
      for (int m = 0; m < MX; ++m) {
        const int64_t row = (m0 + m) * Kp + at;
        const IV xq = load_i(a.q.data() + row);
        const FV xs = load_f(a.scale.data() + row / 4);
        const IV base = load_i(a.base.data() + row / 4);
        for (int j = 0; j < NW; ++j) {
          const IV dp = kSignTrick && Q == kQ8_0 ? dot4(base, abs8(xq), sign_mul(u[j], xq)) : dot4(base, u[j], xq);
          acc[j][m] = fma(to_fp32(dp), mul(s[j], xs), acc[j][m]);
        }
      }
    }
    if constexpr (has_mins(Q))  // - sum_c min_c * dx * sum(qx of chunk c), in the lanes of the accumulator
      for (int m = 0; m < MX; ++m) {
        const FV sums = G::place_sums(_mm256_loadu_ps(a.sums.data() + ((m0 + m) * Kp + k) / kChunk));
        for (int j = 0; j < NW; ++j) acc[j][m] = fma(ga[j].min_lanes(), -sums, acc[j][m]);
      }
  }
  for (int j = 0; j < NW; ++j)
    for (int m = 0; m < MX; ++m) res[m][j] = reduce(acc[j][m]);
}

// Output columns [n0, n0 + NW) for all M rows, up to kRowsX rows of x at a time.
template <int Q, int NW, typename T>
void columns(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, T* out, int64_t out_stride,
             int64_t M, int64_t K, int64_t n0) {
  float res[kRowsX][4] = {};  // (initialised only to quiet -Wmaybe-uninitialized)
  const uint8_t* w0 = w + n0 * row_bytes;
  for (int64_t m0 = 0, mx; m0 < M; m0 += mx) {
    mx = std::min<int64_t>(kRowsX, M - m0);
    switch (mx) {
      case 8: dot_block<Q, NW, 8>(w0, row_bytes, a, m0, K, res); break;
      case 7: dot_block<Q, NW, 7>(w0, row_bytes, a, m0, K, res); break;
      case 6: dot_block<Q, NW, 6>(w0, row_bytes, a, m0, K, res); break;
      case 5: dot_block<Q, NW, 5>(w0, row_bytes, a, m0, K, res); break;
      case 4: dot_block<Q, NW, 4>(w0, row_bytes, a, m0, K, res); break;
      case 3: dot_block<Q, NW, 3>(w0, row_bytes, a, m0, K, res); break;
      case 2: dot_block<Q, NW, 2>(w0, row_bytes, a, m0, K, res); break;
      default: dot_block<Q, NW, 1>(w0, row_bytes, a, m0, K, res); break;
    }
    for (int64_t m = 0; m < mx; ++m)
      for (int j = 0; j < NW; ++j)
        from_float(res[m][j] + (bias != nullptr ? to_float(bias[n0 + j]) : 0.0f), out + (m0 + m) * out_stride + n0 + j);
  }
}

#if defined(NANOSERVE_QUANT_ZMM)
// res[j] = x . w_j for one row of x and four rows of q8_0 W: dot_block<kQ8_0, 4, 1>'s sums with the
// per-block work shared among the rows, for the single-stream decode product (memory-bound only
// if its arithmetic keeps well ahead of memory). A step takes two blocks of each row: the rows' eight
// fp16 scales in one conversion, times x's two block scales in one multiply, spread over each row's
// lanes by one permute; each row's quants as two 32-byte loads joined. The next four rows are
// prefetched meanwhile, as in dot_block.
void q8_0_dot4(const uint8_t* w, int64_t row_bytes, const Activations& a, int64_t K, float* res) {
  constexpr int64_t bytes = layout(kQ8_0).bytes;
  const int64_t num_blocks = K / layout(kQ8_0).values;
  const auto scale = [&](int j, int64_t b) {
    uint16_t h;
    std::memcpy(&h, w + j * row_bytes + b * bytes, sizeof h);
    return static_cast<uint64_t>(h);
  };
  __m512i spread[4];  // lanes 0-7 take scale 2j (row j's first block), lanes 8-15 scale 2j + 1
  for (int j = 0; j < 4; ++j)
    spread[j] = _mm512_inserti64x4(_mm512_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1), 1);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  // Blocks b and b + 1; without a block b + 1 (an odd count), zero scale and quants in its place
  // (x is zero-padded past K).
  const auto step = [&](int64_t b, auto pair) {
    for (int j = 4; j < 8; ++j) {
      __builtin_prefetch(w + j * row_bytes + b * bytes, 0, 3);
      __builtin_prefetch(w + j * row_bytes + b * bytes + 64, 0, 3);
    }
    uint64_t lo = scale(0, b) | scale(1, b) << 32, hi = scale(2, b) | scale(3, b) << 32;
    if constexpr (pair) {
      lo |= scale(0, b + 1) << 16 | scale(1, b + 1) << 48;
      hi |= scale(2, b + 1) << 16 | scale(3, b + 1) << 48;
    }
    const __m256 ws = _mm256_cvtph_ps(_mm_insert_epi64(_mm_cvtsi64_si128(static_cast<int64_t>(lo)),
                                                       static_cast<int64_t>(hi), 1));
    const float* xs = a.scale.data() + b * kChunk / 4;  // x's lane scales, eight per block
    const __m256 xs2 = _mm256_blend_ps(_mm256_set1_ps(xs[0]), _mm256_set1_ps(pair ? xs[8] : 0.0f), 0xaa);
    const __m512 s = _mm512_castps256_ps512(_mm256_mul_ps(ws, xs2));
    const __m512i xq = _mm512_loadu_si512(a.q.data() + b * kChunk);
    const __m512i base = _mm512_loadu_si512(a.base.data() + b * kChunk / 4);
    for (int j = 0; j < 4; ++j) {
      const uint8_t* p = w + j * row_bytes + b * bytes + 2;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i qb = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + bytes))
                              : _mm256_setzero_si256();
      const __m512i u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1), flip);
      const __m512i dp = _mm512_dpbusd_epi32(base, u, xq);
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_permutexvar_ps(spread[j], s), acc[j]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= num_blocks; b += 2) step(b, std::true_type{});
  if (b < num_blocks) step(b, std::false_type{});
  for (int j = 0; j < 4; ++j) res[j] = _mm512_reduce_add_ps(acc[j]);
}
#endif

template <int Q, typename T>
void column_range(const uint8_t* w, int64_t row_bytes, const Activations& a, const T* bias, T* out,
                  int64_t out_stride, int64_t M, int64_t K, int64_t begin, int64_t end) {
  int64_t n = begin;
  if (M == 1) {
#if defined(NANOSERVE_QUANT_ZMM)
    if constexpr (Q == kQ8_0) {
      for (float res[4]; n + 4 <= end; n += 4) {
        q8_0_dot4(w + n * row_bytes, row_bytes, a, K, res);
        for (int j = 0; j < 4; ++j) from_float(res[j] + (bias != nullptr ? to_float(bias[n + j]) : 0.0f), out + n + j);
      }
    } else
#endif
    {
      for (; n + 4 <= end; n += 4) columns<Q, 4>(w, row_bytes, a, bias, out, out_stride, M, K, n);
    }
  }
  for (; n + 2 <= end; n += 2) columns<Q, 2>(w, row_bytes, a, bias, out, out_stride, M, K, n);
  for (; n < end; ++n) columns<Q, 1>(w, row_bytes, a, bias, out, out_stride, M, K, n);
}

#if defined(NANOSERVE_QUANT_AMX)
// --- AMX: bf16 products of many rows of x, W dequantized 32 rows at a time.
//
// For bf16 x, each task dequantizes 32 rows of W to bf16 (dequantize_row: in L2 while it is used)
// and multiplies them with all of x in AMX tiles: rows of W as A tiles (16 rows x 32 values, straight
// from the dequantized rows), x as B tiles (AMX's pair layout, packed once per call), fp32 sums in
// four C tiles (2 x 2 tiles of 16 x 16) across all of K. Against dequantized tiles handed to torch's
// GEMM (the path without AMX) this skips the GEMM's packing of W and the dequantized tile's round trip
// through memory; against the int8 dot products it multiplies many rows of x at AMX's rate.

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
#endif

template <int Q, typename T>
void products(const T* x, const uint8_t* w, const T* bias, T* out, int64_t out_stride, int64_t M, int64_t N,
              int64_t K, int num_threads) {
  constexpr int64_t step = std::max<int64_t>(layout(Q).values, kVecValues);
  const int64_t row_bytes = K / layout(Q).values * layout(Q).bytes, Kp = (K + step - 1) / step * step;
  Activations a;
#if defined(NANOSERVE_QUANT_AMX)
  if constexpr (sizeof(T) == sizeof(uint16_t))
    if (M >= kAmxRows && amx_permitted()) {
      const int64_t N16 = N / 16 * 16;
      amx_products<Q>(x, w, row_bytes, bias, out, out_stride, M, N16, K, num_threads);
      if (N16 < N) {  // the last N % 16 columns through the int8 products
        quantize_activations(x, M, K, Kp, offset_of(Q), a);
        column_range<Q>(w, row_bytes, a, bias, out, out_stride, M, K, N16, N);
      }
      return;
    }
#endif
  quantize_activations(x, M, K, Kp, offset_of(Q), a);
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && M * N * K >= kParallelWork)
  for (int64_t task = 0; task < tasks; ++task)
    column_range<Q>(w, row_bytes, a, bias, out, out_stride, M, K, task * kColumnsPerTask,
                    std::min(N, (task + 1) * kColumnsPerTask));
}

template <typename T>
void quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, T* out, int64_t out_stride, int64_t M,
                  int64_t N, int64_t K, int num_threads) {
  switch (qtype) {
    case kQ8_0: products<kQ8_0>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ4_0: products<kQ4_0>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ4_K: products<kQ4_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ5_K: products<kQ5_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    case kQ6_K: products<kQ6_K>(x, w, bias, out, out_stride, M, N, K, num_threads); break;
    default: break;
  }
}

#else  // no AVX2: each block of W dequantized, then multiplied with x in fp32

constexpr int kIsa = 0;

template <typename T>
inline void dequantize_row_any(int qtype, const uint8_t* src, int64_t K, T* y) {
  std::vector<float> row(K);
  dequantize_row_scalar(qtype, src, K, row.data());
  for (int64_t k = 0; k < K; ++k) from_float(row[k], y + k);
}

template <typename T>
void quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, T* out, int64_t out_stride, int64_t M,
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
template <typename T>
int checked_quant_linear(const T* x, const uint8_t* w, int qtype, const T* bias, T* out, int64_t out_stride,
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

// From how many rows of bf16 x the products multiply W dequantized in AMX tiles (any number from
// there on); 0 where they never do (no AMX in this build, or the OS refuses its tile state).
int nanoserve_quant_amx_rows() {
#if defined(NANOSERVE_QUANT_AMX)
  return amx_permitted() ? static_cast<int>(kAmxRows) : 0;
#else
  return 0;
#endif
}

}  // extern "C"
