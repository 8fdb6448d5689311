// Vector helpers shared by nanoserve's CPU kernels (GCC vector extensions: AVX on x86, pairs of
// NEON registers on ARM; one AVX2 intrinsic where GCC's generic form compiles poorly, the bfloat16
// load8), and the two element types the kernels take: float and bfloat16, the
// latter as its raw 16 bits (uint16_t). No -ffast-math anywhere: in a shared library it would switch
// the whole process to flush-to-zero, so the few transcendental functions are written out here.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace nanoserve {

// Eight floats in one vector register; `uvec8` is the same read from memory aligned only to a float.
typedef float vec8 __attribute__((vector_size(32)));
typedef float uvec8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t ivec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
constexpr int kLanes = 8;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 is a float's top half
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = static_cast<uint16_t>(bits >> 16);
}

// x rounded to T's precision, as a float: what torch holds after an op whose result is a T.
inline float round_to(float x, const float*) { return x; }
inline float round_to(float x, const uint16_t*) {
  uint16_t h;
  from_float(x, &h);
  return to_float(h);
}

inline vec8 load8(const float* src) { return *reinterpret_cast<const uvec8*>(src); }
inline vec8 load8(const uint16_t* src) {
#if defined(__AVX2__)  // one widening load and a shift (GCC splits the generic form into halves)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return (vec8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#else
  u16x8 raw;
  std::memcpy(&raw, src, sizeof raw);
  const u32x8 wide = __builtin_convertvector(raw, u32x8) << 16;
  vec8 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
#endif
}

inline void store8(vec8 x, float* dst) { *reinterpret_cast<uvec8*>(dst) = x; }
inline void store8(vec8 x, uint16_t* dst) {  // from_float, lane by lane
  u32x8 bits;
  std::memcpy(&bits, &x, sizeof bits);
  const u32x8 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x8 quiet = (bits >> 16) | 0x40u;
  const u32x8 out = (bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
  const u16x8 narrow = __builtin_convertvector(out, u16x8);
  std::memcpy(dst, &narrow, sizeof narrow);
}

// store8 then load8: x rounded to T's precision, lane by lane.
inline vec8 round8(vec8 x, const float*) { return x; }
inline vec8 round8(vec8 x, const uint16_t*) {
  uint16_t h[kLanes];
  store8(x, h);
  return load8(h);
}

// Sixteen floats: one AVX-512 register (two AVX ones elsewhere).
typedef float vec16 __attribute__((vector_size(64)));
typedef int32_t ivec16 __attribute__((vector_size(64)));

// e^x for x <= 0, lane by lane, within a few ulp: 2^n * e^r with n = round(x / ln 2) and a
// degree-6 polynomial for e^r on [-ln2/2, ln2/2]. Below -87 it returns e^-87 (2^n stays normal).
// The same operations lane by lane at either width.
template <typename V, typename I>
inline V exp_nonpositive_lanes(V x) {
  x = x < -87.0f ? V{} - 87.0f : x;
  const V y = x * 1.44269504088896341f + 0.5f;
  I n = __builtin_convertvector(y, I);  // truncation; then floor for negative y
  n += (__builtin_convertvector(n, V) > y);  // a true lane is -1
  const V nf = __builtin_convertvector(n, V);
  const V r = x - nf * 0.693359375f + nf * 2.12194440e-4f;  // ln 2 in two parts
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline vec8 exp_nonpositive(vec8 x) { return exp_nonpositive_lanes<vec8, ivec8>(x); }
inline vec16 exp_nonpositive(vec16 x) { return exp_nonpositive_lanes<vec16, ivec16>(x); }

inline float hsum(vec8 v) {  // pairwise, in three shuffle-and-add steps
  typedef float vec4 __attribute__((vector_size(16)));
  vec4 x = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2);
  return x[0];
}

inline float hsum(vec16 v) {  // the halves added, then as a vec8
  return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

inline float hmax(vec8 v) {  // the largest lane (of finite floats), in three shuffle-and-max steps
  typedef float vec4 __attribute__((vector_size(16)));
  const auto max4 = [](vec4 a, vec4 b) { return a > b ? a : b; };
  vec4 x = max4(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
  x = max4(x, __builtin_shufflevector(x, x, 2, 3, 0, 1));
  x = max4(x, __builtin_shufflevector(x, x, 1, 0, 3, 2));
  return x[0];
}
inline float hmax(vec16 v) {
  const vec8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vec8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(lo > hi ? lo : hi);
}

}  // namespace nanoserve
