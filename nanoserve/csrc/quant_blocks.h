// GGUF's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; q4_k, q5_k, q6_k, iq4_xs, q3_k, q2_k) as
// the quantized products read them: the block layouts, the unpacking of a group of blocks into unsigned bytes and lane scales for the
// dot products (Group<Q>), and the dequantization of whole rows (dequantize_row, for
// dequantize_rows).
//
// Private to the products' translation units (included by quant.cpp, moe.cpp and the other quant_*.h
// only; see quant.cpp for the files' roles). Everything is in the unnamed namespace: internal linkage
// in each translation unit, so the compiler inlines and specialises as within a single file.
//
// W layout: [N rows, row_bytes] row-major, each row its blocks side by side, byte for byte as a
// GGUF tensor (nanoserve/model/block_quant.py spells the block layouts out). Every weight value is
// scale * (u - offset) - min with u a small unsigned integer: q8_0 u = q + 128 (offset 128), q4_0 a
// nibble (offset 8), q5_0 five bits (offset 16), q6_k six bits (offset 32), q3_k three bits (offset
// 4), q4_k / q5_k four or five bits (offset 0, a min per 32 values), q2_k two bits (offset 0, a min
// per 16 values), q4_1 / q5_1 four or five bits (offset 0, the block's min m added: min = -m),
// iq4_nl / iq4_xs the nibble's entry of the non-linear table kIq4Values plus 128 (offset 128); the
// scale is per 32 values (q6_k, q3_k, q2_k: per 16). On plain AVX2 (kSignTrick) q8_0's, iq4_nl's and
// iq4_xs's u are the signed values themselves, offset 0 (quant_dot.h).
//
// Invariants: every dequantization here gives each value as ggml computes it, (d * scale) * q -
// dmin * min, so the SIMD rows (dequantize_row) and the scalar blocks (dequantize_block) give the
// same bits; a group's u(c) / uv(v) give chunk c's (vector v's) bytes in the order the activations
// are laid out (value i of a chunk in byte i); int_scales gives a superblock_int format's sub-block
// scales and mins as integers, exactly, and iq4_xs's group its chunks' scales (scale8), exactly.

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_isa.h"

namespace {

// GGUF's tensor type ids (GGMLQuantizationType).
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
              kIQ4_NL = 20, kIQ4_XS = 23;
// iq4_nl's and iq4_xs's 16 values, indexed by a nibble (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int64_t kChunk = 32;  // values per chunk: per activation block and per lane-scale group of W

struct BlockLayout {
  int64_t values, bytes;
};

// Values and bytes per block; {0, 0} for a type the quantized products do not take.
constexpr BlockLayout layout(int qtype) {
  switch (qtype) {
    case kQ8_0: return {32, 34};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
    case kQ3_K: return {256, 110};
    case kQ2_K: return {256, 84};
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

// iq4_xs's eight 6-bit sub-block scales (value ls - 32, signed) at block p: the low nibbles in bytes
// 4-7 (sub-block 2i low, 2i + 1 high nibble of byte 4 + i), the top two bits in the uint16 at 2.
// With BMI2, on one 64-bit word: the nibbles and the bit pairs deposited into their bytes (pdep),
// then ls - 32 as q3_k_scales takes sc - 32 (bit 5 flipped, then sign-extended from it).
inline void iq4_xs_scales(const uint8_t* p, int8_t* ls) {
  const unsigned high = p[2] | static_cast<unsigned>(p[3]) << 8;
#if defined(__BMI2__) && defined(__AVX2__)
  uint32_t nibbles;
  std::memcpy(&nibbles, p + 4, sizeof nibbles);
  const uint64_t flip = 0x2020202020202020ull;
  uint64_t w = (_pdep_u64(nibbles, 0x0f0f0f0f0f0f0f0full) | _pdep_u64(high, 0x3030303030303030ull)) ^ flip;
  const uint64_t sign = w & flip;
  w |= sign << 1 | sign << 2;
  std::memcpy(ls, &w, sizeof w);
#else
  for (int c = 0; c < 8; ++c)
    ls[c] = static_cast<int8_t>((((p[4 + c / 2] >> (4 * (c % 2))) & 0xf) | (((high >> (2 * c)) & 3) << 4)) - 32);
#endif
}

// q3_k's sixteen 6-bit scales (value sc - 32, signed) at its 12 scale bytes p: scale i takes its low
// nibble from byte i % 8 (low nibble for i < 8, high for i >= 8) and its top two bits from bits
// 2 (i / 4), 2 (i / 4) + 1 of byte 8 + i % 4. Done on 64-bit words, eight bytes at once; sc - 32 of
// a 6-bit sc is sc with bit 5 flipped, then sign-extended from bit 5.
inline void q3_k_scales(const uint8_t* p, int8_t* sc) {
  uint64_t nibbles;
  uint32_t top;
  std::memcpy(&nibbles, p, sizeof nibbles);
  std::memcpy(&top, p + 8, sizeof top);
  const uint64_t two = 0x0303030303030303ull, flip = 0x2020202020202020ull;
  const auto bits = [&](int shift) { return static_cast<uint64_t>((top >> shift) & two) << 4; };  // 4 bytes
  uint64_t words[2] = {(nibbles & 0x0f0f0f0f0f0f0f0full) | bits(0) | bits(2) << 32,
                       ((nibbles >> 4) & 0x0f0f0f0f0f0f0f0full) | bits(4) | bits(6) << 32};
  for (uint64_t& w : words) {
    w ^= flip;
    const uint64_t sign = w & flip;
    w |= sign << 1 | sign << 2;
  }
  std::memcpy(sc, words, sizeof words);
}

// One block at p as floats y[0 .. values): each value as ggml computes it, (d * scale) * q - dmin * min.
void dequantize_block(int qtype, const uint8_t* p, float* y) {
  switch (qtype) {
    case kQ4_1:
    case kQ5_0:
    case kQ5_1:
    case kIQ4_NL: {  // d, then (q4_1, q5_1) the min m, (q5_0, q5_1) 32 fifth bits, then 16 bytes of nibbles
      const bool five = qtype == kQ5_0 || qtype == kQ5_1, with_min = qtype == kQ4_1 || qtype == kQ5_1;
      const float d = fp16(p), m = with_min ? fp16(p + 2) : 0.0f;
      const uint8_t* qs = p + 2 + (with_min ? 2 : 0) + (five ? 4 : 0);
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, p + (with_min ? 4 : 2), sizeof qh);
      for (int i = 0; i < 32; ++i) {
        int q = i < 16 ? qs[i] & 0xf : qs[i - 16] >> 4;
        if (five) q |= static_cast<int>((qh >> i) & 1) << 4;
        if (qtype == kIQ4_NL) {
          y[i] = d * static_cast<float>(kIq4Values[q]);
        } else {
          y[i] = d * static_cast<float>(qtype == kQ5_0 ? q - 16 : q);
          if (with_min) y[i] += m;
        }
      }
      break;
    }
    case kIQ4_XS: {
      const float d = fp16(p);
      int8_t ls[8];
      iq4_xs_scales(p, ls);
      for (int c = 0; c < 8; ++c) {
        const float dl = d * static_cast<float>(ls[c]);
        const uint8_t* qs = p + 8 + 16 * c;
        for (int i = 0; i < 32; ++i) y[32 * c + i] = dl * static_cast<float>(kIq4Values[i < 16 ? qs[i] & 0xf : qs[i - 16] >> 4]);
      }
      break;
    }
    case kQ3_K: {  // value 32c + l: two bits of qs[32 (c / 4) + l] at 2 (c % 4), bit c of hmask[l] clear: minus 4
      const float d = fp16(p + 108);
      int8_t sc[16];
      q3_k_scales(p + 96, sc);
      for (int c = 0; c < 8; ++c)
        for (int l = 0; l < 32; ++l) {
          const int q = ((p[32 + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3) | (((p[l] >> c) & 1) << 2);
          y[32 * c + l] = d * static_cast<float>(sc[2 * c + l / 16]) * static_cast<float>(q - 4);
        }
      break;
    }
    case kQ2_K: {  // value 32c + l: two bits of qs[32 (c / 4) + l] at 2 (c % 4); scale and min per 16 values
      const float d = fp16(p + 80), dmin = fp16(p + 82);
      for (int c = 0; c < 8; ++c)
        for (int l = 0; l < 32; ++l) {
          const int q = (p[16 + 32 * (c / 4) + l] >> (2 * (c % 4))) & 3, sc = p[2 * c + l / 16];
          y[32 * c + l] = d * static_cast<float>(sc & 0xf) * static_cast<float>(q) - dmin * static_cast<float>(sc >> 4);
        }
      break;
    }
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

// 32 bytes at p; their low / high nibbles as bytes; lane i of v in all eight lanes.
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }

// Whether a format's values are signed bytes looked up or stored as they are (its u on plain AVX2,
// kSignTrick, where u + 128 would saturate vpmaddubsw), the offset each format's u carries (taken
// off as offset * the activations' sums), whether its values have a min (has_mins: q4_1, q5_1 and
// the k-quants q4_k, q5_k, q2_k) and whether that min is the 32-value block's own (has_lane_mins: q4_1's and
// q5_1's m, what the block adds to each value, times the chunk's sum of qx in exact_chunk_dot; the
// k-quants' mins are superblock_dot's).
constexpr bool signed_values(int qtype) { return qtype == kQ8_0 || qtype == kIQ4_NL || qtype == kIQ4_XS; }
constexpr int offset_of(int qtype) {
  return signed_values(qtype) ? (kSignTrick ? 0 : 128)
         : qtype == kQ4_0     ? 8
         : qtype == kQ5_0     ? 16
         : qtype == kQ6_K     ? 32
         : qtype == kQ3_K     ? 4
                              : 0;
}
constexpr bool has_lane_mins(int qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }
constexpr bool has_mins(int qtype) { return has_lane_mins(qtype) || qtype == kQ4_K || qtype == kQ5_K || qtype == kQ2_K; }

// The 32 bits of `bits` as bytes: byte i is 0x10 where bit i is set, else 0 (q5_0's and q5_1's fifth
// bits in place). Each byte takes the byte of `bits` that holds its bit, then tests its bit there.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// kIq4Values as u (plus 128 unless kSignTrick), in both 128-bit lanes, for vpshufb's lookup by nibble.
inline __m256i iq4_table() {
  constexpr auto u = [](int i) { return static_cast<char>(kIq4Values[i] + (kSignTrick ? 0 : 128)); };
  return _mm256_broadcastsi128_si256(_mm_setr_epi8(u(0), u(1), u(2), u(3), u(4), u(5), u(6), u(7), u(8), u(9), u(10),
                                                   u(11), u(12), u(13), u(14), u(15)));
}

// The 32 values of 16 bytes of nibbles at p, as bytes: values 0-15 the low nibbles, 16-31 the high.
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

#if defined(NANOSERVE_QUANT_ZMM)
// Two runs of 16 bytes of nibbles (q's halves) as two chunks in nibbles16's layout: the 128-bit lanes
// of the result are q's first half's low nibbles, its high nibbles, then the second half's. Each half
// copied to two lanes (one shuffle), the odd lanes shifted right by 4 (a masked shift), all masked.
inline __m512i nibbles32(__m256i q) {
  const __m512i z = _mm512_castsi256_si512(q);
  const __m512i twice = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(1, 1, 0, 0));
  return _mm512_and_si512(_mm512_mask_srli_epi16(twice, 0xff00ff00u, twice, 4), _mm512_set1_epi8(0x0f));
}
#endif

// One group of W's blocks (one block: 32 or 256 values, `values`), decoded for the dot products:
// u(c) chunk c's 32 unsigned bytes; the 256-value formats' uv(v) the same for vector v of the path
// (two chunks with NANOSERVE_QUANT_ZMM), where the 32-value formats pair two groups in a vector
// (pair_u: u(0) of each). iq4_xs's group also gives its eight chunks' scales (scale8); the
// superblock_int formats' scales are int_scales', the 32-value formats' their fp16 d and m, read by
// the products (their groups are the unpacking of u only). Built from the block's address once per
// group, then read per vector.
//
// The template itself is the group of the 32-value formats, one block: its fp16 scale d, then
// (q4_1, q5_1) the fp16 min m, (q5_0, q5_1) 32 fifth bits (bit i tops value i), then the quants:
// q8_0 32 signed bytes, the others 16 bytes of nibbles (values 0-15 the low nibbles, 16-31 the high
// ones; iq4_nl's nibbles index kIq4Values); only u's unpacking differs. The k-quants specialise it
// below. (One template, not a base shared by two specialisations: no layer of inherited
// constructors between dot_block and these members, so the compiler inlines and allocates
// registers as for a plain struct.)
template <int Q>
struct Group {
  static_assert(layout(Q).values == 32, "the 256-value formats have their own Group");
  static constexpr int64_t values = 32;
  static constexpr bool five = Q == kQ5_0 || Q == kQ5_1;
  static constexpr int64_t qs_at = 2 + (has_lane_mins(Q) ? 2 : 0) + (five ? 4 : 0);
  const uint8_t* p;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {}
  __m256i u(int) const {
    if constexpr (Q == kQ8_0) {
      const __m256i q = load32(p + 2);
      return kSignTrick ? q : _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      const __m256i n = nibbles16(p + qs_at);
      if constexpr (Q == kIQ4_NL) return _mm256_shuffle_epi8(iq4_table(), n);
      if constexpr (five) {
        uint32_t qh;
        std::memcpy(&qh, p + qs_at - 4, sizeof qh);
        return _mm256_or_si256(n, fifth_bits(qh));
      }
      return n;
    }
  }
#if defined(NANOSERVE_QUANT_ZMM)
  // A vector is two blocks, this one at a and the next at b (null: none): u(0) of the block at a in
  // bytes 0-31, of the block at b (null: zeros) in bytes 32-63. The 4-bit formats unpack both blocks'
  // nibbles at once (nibbles32); q5_0's and q5_1's fifth bits, a's then b's 32, are one 64-bit mask,
  // bit i adding 0x10 to byte i.
  static IV pair_u(const uint8_t* a, const uint8_t* b) {
    if constexpr (Q == kQ8_0) {
      return join(Group(a).u(0), b != nullptr ? Group(b).u(0) : _mm256_setzero_si256());
    } else {
      const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + qs_at));
      const __m256i q =
          b != nullptr ? _mm256_inserti128_si256(_mm256_castsi128_si256(qa),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs_at)), 1)
                       : _mm256_zextsi128_si256(qa);
      const __m512i n = nibbles32(q);
      if constexpr (Q == kIQ4_NL)
        return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_castsi256_si128(iq4_table())), n);
      if constexpr (five) {
        uint32_t qa_bits, qb_bits = 0;
        std::memcpy(&qa_bits, a + qs_at - 4, sizeof qa_bits);
        if (b != nullptr) std::memcpy(&qb_bits, b + qs_at - 4, sizeof qb_bits);
        const __mmask64 fifth = _cvtu64_mask64(qa_bits | static_cast<uint64_t>(qb_bits) << 32);
        return _mm512_mask_add_epi8(n, fifth, n, _mm512_set1_epi8(0x10));
      }
      return n;
    }
  }
#endif
};

// q4_k and q5_k: chunk c's nibbles are the low (c even) or high (c odd) ones of the 32 bytes at
// qs + 32 (c / 2), q5_k's topped (bit 4) by bit c of the 32 bytes at 16.
template <int Q>
struct KGroup {
  static constexpr int64_t values = 256;
  const uint8_t* p;
  KGroup() = default;
  explicit KGroup(const uint8_t* block) : p(block) {}
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
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const {  // chunks 2v (low nibbles) and 2v + 1 (high nibbles) of the same 32 bytes
    constexpr int64_t qs = Q == kQ5_K ? 48 : 16;
    const __m512i q = _mm512_broadcast_i64x4(load32(p + qs + 32 * v));
    // The upper half shifted by 4 (a masked shift by an immediate), then both halves masked.
    const __m512i n = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xffff0000u, q, 4), _mm512_set1_epi8(0x0f));
    if constexpr (Q == kQ5_K) {
      const __m512i shift = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(2 * v))),
                                               _mm256_set1_epi16(static_cast<int16_t>(2 * v + 1)), 1);
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(p + 16)), shift),
                                           _mm512_set1_epi8(1));
      return _mm512_or_si512(n, _mm512_slli_epi16(bit, 4));
    }
    return n;
  }
#else
  IV uv(int v) const { return u(v); }
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
struct Group<kQ6_K> {  // chunk c: group g = c % 4 of half c / 4 (see dequantize_block)
  static constexpr int64_t values = 256;
  const uint8_t* p;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {}
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
#else
  IV uv(int v) const { return u(v); }
#endif
};

// iq4_xs: eight sub-blocks of 32 values, chunk c the 16 bytes of nibbles at 8 + 16c (indexing
// kIq4Values, laid out as in the 32-value formats), scaled by d * ls[c] (iq4_xs_scales): scale8.
template <>
struct Group<kIQ4_XS> {
  static constexpr int64_t values = 256;
  const uint8_t* p;
  __m256 scale8;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {
    int8_t ls[8];
    iq4_xs_scales(block, ls);
    int64_t packed;
    std::memcpy(&packed, ls, sizeof packed);
    scale8 = _mm256_mul_ps(_mm256_set1_ps(fp16(block)),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(packed))));
  }
  __m256i u(int c) const { return _mm256_shuffle_epi8(iq4_table(), nibbles16(p + 8 + 16 * c)); }
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const {  // chunks 2v, 2v + 1: the nibbles of bytes 0-15, then of bytes 16-31, at 8 + 32v
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_castsi256_si128(iq4_table())),
                               nibbles32(load32(p + 8 + 32 * v)));
  }
#else
  IV uv(int v) const { return u(v); }
#endif
};

// The two bits at 2 (c % 4) of the 32 bytes at q + 32 (c / 4) (q3_k's and q2_k's low bits of chunk
// c): a shift of the 16-bit lanes, then a mask (the bits wanted stay within their byte).
inline __m256i two_bits(const uint8_t* q, int c) {
  return _mm256_and_si256(_mm256_srl_epi16(load32(q + 32 * (c / 4)), _mm_cvtsi32_si128(2 * (c % 4))),
                          _mm256_set1_epi8(3));
}

#if defined(NANOSERVE_QUANT_ZMM)
// The 32 bytes at p in both halves, shifted right by `lo` (lower half) and `hi` (upper) per 16-bit
// lane, masked by `mask`: two chunks' bits of the same bytes in one vector.
inline __m512i shifted_pair(const uint8_t* p, int lo, int hi, char mask) {
  const __m512i by = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<int16_t>(lo))),
                                        _mm256_set1_epi16(static_cast<int16_t>(hi)), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(load32(p)), by), _mm512_set1_epi8(mask));
}
#endif

// q3_k: value 32c + l has u = its two bits of qs[32 (c / 4) + l] (the 64 bytes at 32) at bit
// 2 (c % 4), topped (bit 2) by bit c of hmask[l] (the 32 bytes at 0), offset 4.
template <>
struct Group<kQ3_K> {
  static constexpr int64_t values = 256;
  const uint8_t* p;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {}
  __m256i u(int c) const {
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
    return _mm256_or_si256(two_bits(p + 32, c), _mm256_slli_epi16(high, 2));
  }
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const {  // chunks 2v, 2v + 1: the same 32 bytes of qs and of hmask, each shifted two ways
    const __m512i low = shifted_pair(p + 32 + 32 * (v / 2), 4 * (v % 2), 4 * (v % 2) + 2, 3);
    // hmask's bits 2v, 2v + 1 moved straight to bit 2 (left by 2, 1 for v = 0, else right by 2v - 2,
    // 2v - 1), masked, then merged with the low bits by one vpternlogd: low | high.
    const __m512i hm = _mm512_broadcast_i64x4(load32(p));
    const __m512i high =
        v == 0 ? _mm512_sllv_epi16(hm, _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_set1_epi16(1), 1))
               : _mm512_srlv_epi16(hm, _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * v - 2)),
                                                          _mm256_set1_epi16(static_cast<int16_t>(2 * v - 1)), 1));
    return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi8(4), 0xf8);
  }
#else
  IV uv(int v) const { return u(v); }
#endif
};

// q2_k: value 32c + l has u = its two bits of qs[32 (c / 4) + l] (the 64 bytes at 16) at bit
// 2 (c % 4), offset 0.
template <>
struct Group<kQ2_K> {
  static constexpr int64_t values = 256;
  const uint8_t* p;
  Group() = default;
  explicit Group(const uint8_t* block) : p(block) {}
  __m256i u(int c) const { return two_bits(p + 16, c); }
#if defined(NANOSERVE_QUANT_ZMM)
  IV uv(int v) const { return shifted_pair(p + 16 + 32 * (v / 2), 4 * (v % 2), 4 * (v % 2) + 2, 3); }
#else
  IV uv(int v) const { return u(v); }
#endif
};

// q3_k_scales of the block at p in one vector's bytes, computed in registers (no round trip through
// memory): the 16 bytes at p + 94 (the block's last, so the load stays inside it) hold the 12 scale
// bytes at 2 .. 13; scale i's nibble is byte 2 + i % 8 (low nibble for i < 8, high for i >= 8), its top
// two bits those of byte 10 + i % 4 at 2 (i / 4) (one variable shift per dword: dword i / 4), and
// sc - 32 a byte subtraction.
inline __m128i q3_k_scales16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 94));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9));
  const __m128i nibbles = _mm_and_si128(_mm_unpacklo_epi64(low, _mm_srli_epi16(low, 4)), _mm_set1_epi8(0x0f));
  const __m128i top = _mm_srlv_epi32(_mm_shuffle_epi8(v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13,
                                                                       10, 11, 12, 13)),
                                     _mm_setr_epi32(0, 2, 4, 6));
  const __m128i sc = _mm_or_si128(nibbles, _mm_and_si128(_mm_slli_epi32(top, 4), _mm_set1_epi8(0x30)));
  return _mm_sub_epi8(sc, _mm_set1_epi8(32));
}

// The 256-value formats whose products accumulate each super-block in int32 (quant_dot.h's
// superblock_dot): their u fit vpmaddubsw (u <= 63, no saturation) and their sub-block scales and
// mins are small integers. (iq4_xs's u = table + 128 would saturate it: it is an exact_chunks format.)
constexpr bool superblock_int(int qtype) {
  return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K || qtype == kQ3_K || qtype == kQ2_K;
}

// The formats whose products sum each 32-value chunk's products exactly in int32 and take the sum
// into fp32 with one step per chunk (quant_dot.h's exact_chunk_dot, and quant_panel.h's kernel from
// kPanelMinRows rows of x on): every format but the superblock_int ones, that is the 32-value
// blocks, which begin with their fp16 scale d (q4_1 and q5_1 then their fp16 min), and iq4_xs,
// whose chunks' scales are d times a small integer (exact in fp32).
constexpr bool exact_chunks(int qtype) { return layout(qtype).values != 0 && !superblock_int(qtype); }

// A super-block's scales as integers: value 16i + l (i < 16) = d * s16[i] * (u - offset) -
// dmin * m16[i], with s16 and m16 sixteen int16 lanes (q4_k's and q5_k's per-32 scales and mins
// each in two lanes; m16 zero for q6_k and q3_k) and d, dmin the block's fp16 factors.
struct IntScales {
  __m256i s16, m16;
  float d, dmin;
};

// The two fp16 values at p (d, then dmin) as floats, in one conversion.
inline void two_fp16(const uint8_t* p, float* d, float* dmin) {
  uint32_t both;
  std::memcpy(&both, p, sizeof both);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both)));
  *d = _mm_cvtss_f32(f);
  *dmin = _mm_cvtss_f32(_mm_movehdup_ps(f));
}

template <int Q>
inline IntScales int_scales(const uint8_t* p) {
  static_assert(superblock_int(Q), "the super-block formats only");
  if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // k_scales in one vector: bytes 0-3 scales 0-3 (b[0..3] & 63), 4-7 scales 4-7 (b[8..11] & 15,
    // topped by b[0..3] >> 6), 8-11 mins 0-3 (b[4..7] & 63), 12-15 mins 4-7 (b[8..11] >> 4, topped
    // by b[4..7] >> 6); the 16-byte load reads 4 bytes of the quants past the scales, unused.
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i lo = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i hi = _mm_shuffle_epi8(b, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
    const __m128i upper = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
    const __m128i both = _mm_or_si128(
        _mm_or_si128(_mm_and_si128(lo, keep), _mm_and_si128(_mm_srli_epi16(lo, 4), upper)),
        _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
    IntScales r{_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(both, both)),
                _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(both, both)), 0.0f, 0.0f};  // each byte twice
    two_fp16(p, &r.d, &r.dmin);
    return r;
  } else if constexpr (Q == kQ6_K) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192))),
            _mm256_setzero_si256(), fp16(p + 208), 0.0f};
  } else if constexpr (Q == kQ3_K) {
    return {_mm256_cvtepi8_epi16(q3_k_scales16(p)), _mm256_setzero_si256(), fp16(p + 108), 0.0f};
  } else {  // q2_k: byte i = scale i (low nibble) and min i (high nibble)
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    IntScales r{_mm256_and_si256(b, _mm256_set1_epi16(0xf)), _mm256_srli_epi16(b, 4), 0.0f, 0.0f};
    two_fp16(p + 80, &r.d, &r.dmin);
    return r;
  }
}

// Group Q's scales at block p as dequantize_block computes them: s[i] that of values 16i .. 16i + 15,
// mins[i] (formats with mins) the min of those values (-m for q4_1's and q5_1's added m).
template <int Q>
inline void group_scales(const uint8_t* p, float* s, float* mins) {
  if constexpr (layout(Q).values == 32) {
    s[0] = s[1] = fp16(p);
    if constexpr (has_lane_mins(Q)) mins[0] = mins[1] = -fp16(p + 2);  // value d * q + m
  } else if constexpr (Q == kIQ4_XS) {
    const float d = fp16(p);
    int8_t ls[8];
    iq4_xs_scales(p, ls);
    for (int c = 0; c < 8; ++c) s[2 * c] = s[2 * c + 1] = d * static_cast<float>(ls[c]);
  } else if constexpr (Q == kQ3_K) {
    const float d = fp16(p + 108);
    int8_t sc[16];
    q3_k_scales(p + 96, sc);
    for (int i = 0; i < 16; ++i) s[i] = d * static_cast<float>(sc[i]);
  } else if constexpr (Q == kQ2_K) {
    const float d = fp16(p + 80), dmin = fp16(p + 82);
    for (int i = 0; i < 16; ++i) {
      s[i] = d * static_cast<float>(p[i] & 0xf);
      mins[i] = dmin * static_cast<float>(p[i] >> 4);
    }
  } else if constexpr (has_mins(Q)) {
    const float d = fp16(p), dmin = fp16(p + 2);
    uint64_t sc, mn;
    k_scales(p + 4, &sc, &mn);
    for (int c = 0; c < 8; ++c) {
      s[2 * c] = s[2 * c + 1] = d * static_cast<float>((sc >> (8 * c)) & 0xff);
      mins[2 * c] = mins[2 * c + 1] = dmin * static_cast<float>((mn >> (8 * c)) & 0xff);
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

// A chunk of 32 bytes u as T at dst: s_lo, s_hi the scales of values 0-15 and 16-31, min_lo, min_hi
// their mins.
template <bool signed_u, bool with_min, typename T>
inline void dequantize_chunk(__m256i u, int offset, float s_lo, float s_hi, float min_lo, float min_hi, T* dst) {
#if defined(NANOSERVE_QUANT_ZMM)
  store32(values16<signed_u, with_min>(_mm256_castsi256_si128(u), offset, s_lo, min_lo),
          values16<signed_u, with_min>(_mm256_extracti128_si256(u, 1), offset, s_hi, min_hi), dst);
#else
  for (int h = 0; h < 4; ++h) {
    const __m128i bytes = _mm_srli_si128(h < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1),
                                         8 * (h % 2));
    const __m256i wide = signed_u ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    __m256 v = _mm256_mul_ps(_mm256_set1_ps(h < 2 ? s_lo : s_hi),
                             _mm256_cvtepi32_ps(_mm256_sub_epi32(wide, _mm256_set1_epi32(offset))));
    if constexpr (with_min) v = _mm256_sub_ps(v, _mm256_set1_ps(h < 2 ? min_lo : min_hi));
    store8(v, dst + 8 * h);
  }
#endif
}

// One row of W [K] as T, chunk by chunk through the groups' unsigned bytes (q8_0: its signed quants
// as they are): value = s * (u - offset) - min, as dequantize_block computes it (so the same bits).
template <int Q, typename T>
void dequantize_row(const uint8_t* src, int64_t K, T* y) {
  using G = Group<Q>;
  constexpr int64_t chunks = G::values / kChunk;
  for (int64_t gi = 0; gi < K / G::values; ++gi) {
    const uint8_t* p = src + gi * layout(Q).bytes;
    float s[G::values / 16], mins[G::values / 16] = {};
    group_scales<Q>(p, s, mins);
    T* out = y + gi * G::values;
    if constexpr (Q == kQ8_0) {
      dequantize_chunk<true, false>(load32(p + 2), 0, s[0], s[1], 0.0f, 0.0f, out);
    } else {
      const G g(p);
      for (int c = 0; c < chunks; ++c)
        dequantize_chunk<kSignTrick && signed_values(Q), has_mins(Q) || has_lane_mins(Q)>(
            g.u(c), offset_of(Q), s[2 * c], s[2 * c + 1], mins[2 * c], mins[2 * c + 1], out + c * kChunk);
    }
  }
}

template <typename T>
inline void dequantize_row_any(int qtype, const uint8_t* src, int64_t K, T* y) {
  switch (qtype) {
    case kQ8_0: dequantize_row<kQ8_0>(src, K, y); break;
    case kQ4_0: dequantize_row<kQ4_0>(src, K, y); break;
    case kQ4_1: dequantize_row<kQ4_1>(src, K, y); break;
    case kQ5_0: dequantize_row<kQ5_0>(src, K, y); break;
    case kQ5_1: dequantize_row<kQ5_1>(src, K, y); break;
    case kIQ4_NL: dequantize_row<kIQ4_NL>(src, K, y); break;
    case kIQ4_XS: dequantize_row<kIQ4_XS>(src, K, y); break;
    case kQ3_K: dequantize_row<kQ3_K>(src, K, y); break;
    case kQ2_K: dequantize_row<kQ2_K>(src, K, y); break;
    case kQ4_K: dequantize_row<kQ4_K>(src, K, y); break;
    case kQ5_K: dequantize_row<kQ5_K>(src, K, y); break;
    case kQ6_K: dequantize_row<kQ6_K>(src, K, y); break;
    default: break;
  }
}

#else  // no AVX2: the scalar blocks

template <typename T>
inline void dequantize_row_any(int qtype, const uint8_t* src, int64_t K, T* y) {
  std::vector<float> row(K);
  dequantize_row_scalar(qtype, src, K, row.data());
  for (int64_t k = 0; k < K; ++k) from_float(row[k], y + k);
}

#endif

}  // namespace
