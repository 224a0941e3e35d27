// The primitives the fused COAT optimizer steps on the CPU share (cpu_adamw.cpp, cpu_lion.cpp): portable_math's
// log2/exp2 polynomials, the round-to-nearest-even saturating FP8 encodings, Dynamic Range Expansion's group
// parameters and encoder (coat_kernels.optim.dre_reference's operations, in the same fp32 order), the FP8 log2-table
// lookup, bf16 conversions, master remainders and the parameter / gradient element types. Every function has
// internal linkage: each library that includes this file gets its own copy.
#ifndef COAT_DRE_CPU_H_
#define COAT_DRE_CPU_H_

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxGroup = 1024;
constexpr float kMinNormal = 1.17549435082228750797e-38f;  // 2^-126: smaller magnitudes count as zero
constexpr float kLog2RatioEps = 1.9073486328125e-06f;      // 2^-19: log2 R at or below counts as constant

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// Polynomials of kernels/portable_math.py, their fp32 coefficients as exact hexadecimal literals, Horner's rule with
// one fused multiply-add per step (written out: the loops over elements then vectorize).
inline float log2_poly4(float f) {
  float r = std::fma(0x1.05ce42p-2f, f, -0x1.9083a2p-2f);
  r = std::fma(r, f, 0x1.f0dc10p-2f);
  r = std::fma(r, f, -0x1.70eac0p-1f);
  return std::fma(r, f, 0x1.71515ap+0f);
}
inline float log2_poly3(float f) {
  float r = std::fma(-0x1.51ffc4p-2f, f, 0x1.09889ep-1f);
  r = std::fma(r, f, -0x1.732d04p-1f);
  return std::fma(r, f, 0x1.710fcep+0f);
}
inline float exp2_poly4(float f) {
  float r = std::fma(0x1.3d1086p-7f, f, 0x1.ca1d18p-5f);
  r = std::fma(r, f, 0x1.ebf906p-3f);
  r = std::fma(r, f, 0x1.62e0c2p-1f);
  return std::fma(r, f, 0x1.000002p+0f);
}
inline float exp2_poly3(float f) {
  float r = std::fma(0x1.c34958p-5f, f, 0x1.f0da64p-3f);
  r = std::fma(r, f, 0x1.62f51ap-1f);
  return std::fma(r, f, 0x1.fff6b0p-1f);
}

// portable_math.log2: x >= 0; -inf below 2^-126.
inline float log2_p(float x, bool coarse) {
  uint32_t bits = bits_of(x);
  uint32_t mant = (bits & 0x7FFFFFu) | 0x3F800000u;
  uint32_t fold = mant > 0x3FB504F3u ? 1u : 0u;
  mant = fold ? mant - 0x00800000u : mant;
  int32_t exponent = static_cast<int32_t>(bits >> 23) + static_cast<int32_t>(fold);
  float e = float_of(static_cast<uint32_t>(exponent + (0x4B000000 + 129))) - 8388864.0f;
  float f = float_of(mant) - 1.0f;
  float r = std::fma(f, coarse ? log2_poly3(f) : log2_poly4(f), e);
  return x >= kMinNormal ? r : -INFINITY;
}

// portable_math.exp2 for y < 127.5 (the decoder's exponents in groups whose values stay below 2^127): 0 below -126.
inline float exp2_unsaturated(float y) {
  float t = y + 12582912.0f;
  uint32_t n = bits_of(t) - 0x4B400000u;
  float f = y - (t - 12582912.0f);
  return y < -126.0f ? 0.0f : exp2_poly4(f) * float_of((n + 127u) << 23);
}

// portable_math.exp2: 0 below -126; the fine one saturates at fp32's maximum.
inline float exp2_p(float y, bool coarse) {
  float t = y + 12582912.0f;
  uint32_t n = bits_of(t) - 0x4B400000u;
  float f = y - (t - 12582912.0f);
  float r;
  if (coarse) {
    r = exp2_poly3(f) * float_of((n + 127u) << 23);
  } else {  // 2^n as 2^min(n, 127) times 1 or 2, saturated at fp32's maximum
    const bool high = static_cast<int32_t>(n) > 127;
    r = (exp2_poly4(f) * float_of(((high ? 127u : n) + 127u) << 23)) * (high ? 2.0f : 1.0f);
    r = r > FLT_MAX ? FLT_MAX : r;
  }
  return y < -126.0f ? 0.0f : r;
}

struct Format {  // an FP8 format's encoding
  int mantissa_bits, min_normal_exp, bias;
  float max, min_subnormal, inv_min_subnormal;
};

// Round-to-nearest-even FP8 code of the magnitude a (0 <= a <= the format's max; NaN gives the NaN code), for a format
// with M mantissa bits, smallest normal exponent MIN_EXP and exponent bias BIAS. Normal range: the fp32 bits rounded
// to M mantissa bits in integer arithmetic (a carry out of the mantissa moves into the exponent, as it should), then
// re-biased; below 2^MIN_EXP: the nearest multiple of the smallest subnormal (a * 1/min_subnormal is exact; adding
// 1.5 * 2^23 rounds it to an integer, nearest even). Branch-free, so that the loops calling it vectorize.
template <int M, int MIN_EXP, int BIAS>
inline uint32_t fp8_magnitude_code(float a, float inv_min_subnormal) {
  const uint32_t b = bits_of(a);
  const uint32_t rounded = (b + ((1u << (22 - M)) - 1u) + ((b >> (23 - M)) & 1u)) >> (23 - M);
  const uint32_t normal = rounded - (static_cast<uint32_t>(127 - BIAS) << M);
  const uint32_t subnormal = bits_of(a * inv_min_subnormal + 12582912.0f) - 0x4B400000u;
  const uint32_t code = b >= static_cast<uint32_t>(127 + MIN_EXP) << 23 ? normal : subnormal;
  return a != a ? (M == 3 ? 0x7Fu : 0x7Eu) : code;
}

struct Moment {  // dre_reference.DREConfig, with the constants the kernels use
  Format fmt;
  bool expand, keep_nonzero;
  float log2_max, numerator, inv_expand_min, k_max;
};

struct Meta { float k, log2_center, log2_scale_q; };

// dre_reference.group_params
inline Meta group_params(float big, float small, const Moment& c) {
  bool nonzero = big >= kMinNormal;
  float log2_big = log2_p(nonzero ? big : 1.0f, false);
  float log2_small = log2_p(nonzero ? small : 1.0f, false);
  Meta m;
  if (c.expand) {
    float log2_ratio = log2_big - log2_small;
    float k = std::floor(c.numerator / log2_ratio) * c.inv_expand_min;
    k = k < c.inv_expand_min ? c.inv_expand_min : (k > c.k_max ? c.k_max : k);
    m.k = log2_ratio <= kLog2RatioEps ? 1.0f : k;
    m.log2_center = (log2_big + log2_small) * 0.5f;
  } else {
    m.k = 1.0f;
    m.log2_center = 0.0f;
  }
  m.log2_scale_q = m.k * (log2_big - m.log2_center);
  return m;
}

// dre_reference.encode of a group's values x[0:len] into codes q
template <int M, int MIN_EXP, int BIAS>
void encode_group(const float* x, uint8_t* q, int len, const Meta m, const Moment c) {
  const float offset = (m.log2_scale_q - c.log2_max) + m.k * m.log2_center;
  const float max = c.fmt.max, min_sub = c.fmt.min_subnormal, inv_min_sub = c.fmt.inv_min_subnormal;
  const float k = m.k;
  const bool keep_nonzero = c.keep_nonzero;
#pragma omp simd
  for (int i = 0; i < len; ++i) {
    const float ax = std::fabs(x[i]);
    float y = exp2_p(std::fma(k, log2_p(ax, true), -offset), true);
    y = keep_nonzero && ax >= kMinNormal && y < min_sub ? min_sub : y;
    y = y > max ? max : y;
    // the reference negates as 0 - y: a zero y stays +0, a nonzero one keeps the sign even when it rounds to 0
    const uint32_t sign = x[i] < 0.0f && y != 0.0f ? 0x80u : 0u;
    q[i] = static_cast<uint8_t>(sign | fp8_magnitude_code<M, MIN_EXP, BIAS>(y, inv_min_sub));
  }
}

inline void encode(const float* x, uint8_t* q, int len, const Meta& m, const Moment& c) {
  if (c.fmt.mantissa_bits == 3) {
    encode_group<3, -6, 7>(x, q, len, m, c);
  } else {
    encode_group<2, -14, 15>(x, q, len, m, c);
  }
}

inline float bf16_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float x) {  // round to nearest even, NaN kept (as torch's cast)
  const uint32_t u = bits_of(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

// out[i] = table[codes[i]] for a code's log2 table of 256 entries whose halves are equal (the sign bit does not
// matter). With AVX-512 the 128 distinct entries stay in eight registers and each 16 codes take four two-register
// permutes and three blends (a gather per 16 codes is several times slower on recent x86 cores).
inline void lookup(const uint8_t* codes, int len, const float* table, float* out) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 t0 = _mm512_loadu_ps(table), t1 = _mm512_loadu_ps(table + 16), t2 = _mm512_loadu_ps(table + 32),
               t3 = _mm512_loadu_ps(table + 48), t4 = _mm512_loadu_ps(table + 64), t5 = _mm512_loadu_ps(table + 80),
               t6 = _mm512_loadu_ps(table + 96), t7 = _mm512_loadu_ps(table + 112);
  const __m512i bit5 = _mm512_set1_epi32(32), bit6 = _mm512_set1_epi32(64);
  for (; i + 16 <= len; i += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __mmask16 upper32 = _mm512_test_epi32_mask(idx, bit5), upper64 = _mm512_test_epi32_mask(idx, bit6);
    const __m512 low = _mm512_mask_blend_ps(upper32, _mm512_permutex2var_ps(t0, idx, t1),
                                            _mm512_permutex2var_ps(t2, idx, t3));
    const __m512 high = _mm512_mask_blend_ps(upper32, _mm512_permutex2var_ps(t4, idx, t5),
                                             _mm512_permutex2var_ps(t6, idx, t7));
    _mm512_storeu_ps(out + i, _mm512_mask_blend_ps(upper64, low, high));
  }
#endif
  for (; i < len; ++i) out[i] = table[codes[i]];
}

// master_remainders.join / split: the fp32 master of a bf16 parameter hi and its remainder lo, and back (hi is the
// master's upper half rounded by lo, ties away from zero; a NaN upper half of magnitude 0x7FFF is never rounded up).
inline float join_master(uint16_t hi, uint16_t lo) {
  const uint32_t borrow = lo >= 0x8000u && (hi & 0x7FFFu) != 0x7FFFu ? 1u : 0u;
  return float_of(static_cast<uint32_t>(static_cast<uint16_t>(hi - borrow)) << 16 | lo);
}

inline void split_master(float x, uint16_t* hi, uint16_t* lo) {
  const uint32_t b = bits_of(x), h = b >> 16, l = b & 0xFFFFu;
  *hi = static_cast<uint16_t>(h + (l >= 0x8000u && (h & 0x7FFFu) != 0x7FFFu ? 1u : 0u));
  *lo = static_cast<uint16_t>(l);
}

// Element types: load / store convert one element; load_param / store_param read and write a parameter's fp32 value
// at i (r: the master remainders, used by BF16R only).
struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float load_param(const float* p, const uint16_t*, int i) { return p[i]; }
  static void store_param(float* p, uint16_t*, int i, float x) { p[i] = x; }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
  static float load_param(const uint16_t* p, const uint16_t*, int i) { return bf16_to_float(p[i]); }
  static void store_param(uint16_t* p, uint16_t*, int i, float x) { p[i] = float_to_bf16(x); }
};
struct BF16R {  // a bf16 parameter with its master remainders
  using T = uint16_t;
  static float load_param(const uint16_t* p, const uint16_t* r, int i) { return join_master(p[i], r[i]); }
  static void store_param(uint16_t* p, uint16_t* r, int i, float x) { split_master(x, p + i, r + i); }
};

// the remainders from element s on (none without remainders)
inline uint16_t* shifted(uint16_t* r, int64_t s) { return r == nullptr ? nullptr : r + s; }

Moment moment(const float* c, const int* i) {
  // c: log2_max, numerator, inv_expand_min, k_max, fp8 max, min_subnormal; i: expand, keep_nonzero, mantissa bits,
  // min normal exponent, exponent bias
  return Moment{Format{i[2], i[3], i[4], c[4], c[5], 1.0f / c[5]}, i[0] != 0, i[1] != 0, c[0], c[1], c[2], c[3]};
}

}  // namespace

#endif  // COAT_DRE_CPU_H_
