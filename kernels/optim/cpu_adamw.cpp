// The fused COAT AdamW step on the CPU, bit-exact with coat_kernels.optim.dre_reference.fused_adamw_step (and so
// with the Triton/Gluon kernel): per quantization group, dequantize both FP8 moments, AdamW, re-quantize with Dynamic
// Range Expansion; groups whose new second moment is not finite keep everything. The same fp32 operation sequence as
// the reference: IEEE division and square root, fused multiply-adds exactly where the reference writes pm.fma
// (std::fma; built with -ffp-contract=off so that nothing else is fused), portable_math's log2/exp2 polynomials, and
// round-to-nearest-even, saturating FP8 encodings. Groups run in parallel (OpenMP); the loops over a group's elements
// are plain fp32 arithmetic the compiler vectorizes; the code -> log2 lookups use AVX-512 permutes where available.
#include <cfloat>
#include <cmath>
#include <cstdint>
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

struct Scalars { float decay, step_size, inv_bc2_sqrt, eps, beta1, one_minus_beta1, beta2, one_minus_beta2; };

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
};

struct Extremes {  // what a group's new moments need for their metadata and the non-finite rule
  int nonfinite;
  float m_big, v_big, m_small, v_small;
};

// Dequantize a group's moments and update them with the gradient: the new m, v of the group's elements, and their
// extremes. SATURATE: the decoder's exp2 may see exponents of 127.5 or more (moments near fp32's maximum); below that
// both exp2 variants give the same bits.
template <typename GT, bool SATURATE>
inline Extremes update_moments(const typename GT::T* grad, const uint8_t* m_codes, const uint8_t* v_codes, int len,
                               const Scalars& h, const float* m_table, const float* v_table, float m_inv_k,
                               float m_bias, float v_inv_k, float v_bias, float* m, float* v) {
  float m_log2[kMaxGroup], v_log2[kMaxGroup];
  lookup(m_codes, len, m_table, m_log2);
  lookup(v_codes, len, v_table, v_log2);
  int nonfinite = 0;
  float m_big = 0.0f, v_big = 0.0f, m_small = INFINITY, v_small = INFINITY;
#pragma omp simd reduction(| : nonfinite) reduction(max : m_big, v_big) reduction(min : m_small, v_small)
  for (int i = 0; i < len; ++i) {
    const uint8_t mr = m_codes[i], vr = v_codes[i];
    float mi = SATURATE ? exp2_p(std::fma(m_log2[i], m_inv_k, m_bias), false)
                        : exp2_unsaturated(std::fma(m_log2[i], m_inv_k, m_bias));
    float vi = SATURATE ? exp2_p(std::fma(v_log2[i], v_inv_k, v_bias), false)
                        : exp2_unsaturated(std::fma(v_log2[i], v_inv_k, v_bias));
    mi = mr >= 128 ? 0.0f - mi : mi;
    vi = vr >= 128 ? 0.0f - vi : vi;
    const float g = GT::load(grad[i]);
    mi = std::fma(mi, h.beta1, g * h.one_minus_beta1);
    vi = std::fma(vi, h.beta2, (g * g) * h.one_minus_beta2);
    m[i] = mi;
    v[i] = vi;
    const float am = std::fabs(mi), av = std::fabs(vi);
    nonfinite |= av <= 3.40282347e+38f ? 0 : 1;  // NaN or Inf
    m_big = am > m_big ? am : m_big;
    v_big = av > v_big ? av : v_big;
    m_small = am >= kMinNormal && am < m_small ? am : m_small;
    v_small = av >= kMinNormal && av < v_small ? av : v_small;
  }
  return Extremes{nonfinite, m_big, v_big, m_small, v_small};
}

// AdamW's parameter update of a group, in place, from its new moments.
template <typename PT>
inline void update_params(typename PT::T* param, const float* m, const float* v, int len, const Scalars& h) {
#pragma omp simd
  for (int i = 0; i < len; ++i) {
    const float denom = std::fma(std::sqrt(v[i]), h.inv_bc2_sqrt, h.eps);
    param[i] = PT::store(std::fma(-h.step_size, m[i] / denom, PT::load(param[i]) * h.decay));
  }
}

template <typename PT, typename GT>
int64_t step(typename PT::T* param, const typename GT::T* grad, uint8_t* m_codes, float* m_meta, uint8_t* v_codes,
             float* v_meta, const int64_t* starts, const int64_t* lengths, int64_t n_groups, const Scalars h,
             const Moment mc, const Moment vc, const float* m_table, const float* v_table, bool skip_nonfinite) {
  int64_t skipped = 0;
#pragma omp parallel for schedule(static) reduction(+ : skipped)
  for (int64_t j = 0; j < n_groups; ++j) {
    const int64_t s = starts[j];
    const int len = static_cast<int>(lengths[j]);
    float m[kMaxGroup], v[kMaxGroup];
    const float m_inv_k = 1.0f / m_meta[j], v_inv_k = 1.0f / v_meta[j];
    const float m_bias = (m_meta[2 * n_groups + j] - mc.log2_max) * m_inv_k + m_meta[n_groups + j];
    const float v_bias = (v_meta[2 * n_groups + j] - vc.log2_max) * v_inv_k + v_meta[n_groups + j];
    // the largest decoder exponent of the group: its largest code's
    const bool saturate = std::fma(mc.log2_max, m_inv_k, m_bias) >= 127.0f ||
                          std::fma(vc.log2_max, v_inv_k, v_bias) >= 127.0f;
    const Extremes x = saturate
        ? update_moments<GT, true>(grad + s, m_codes + s, v_codes + s, len, h, m_table, v_table, m_inv_k, m_bias,
                                   v_inv_k, v_bias, m, v)
        : update_moments<GT, false>(grad + s, m_codes + s, v_codes + s, len, h, m_table, v_table, m_inv_k, m_bias,
                                    v_inv_k, v_bias, m, v);
    if (x.nonfinite != 0 && skip_nonfinite) {  // the group keeps its parameters, codes and metadata
      ++skipped;
      continue;
    }
    update_params<PT>(param + s, m, v, len, h);
    const Meta mm = group_params(x.m_big, x.m_small, mc), vm = group_params(x.v_big, x.v_small, vc);
    encode(m, m_codes + s, len, mm, mc);
    encode(v, v_codes + s, len, vm, vc);
    m_meta[j] = mm.k;
    m_meta[n_groups + j] = mm.log2_center;
    m_meta[2 * n_groups + j] = mm.log2_scale_q;
    v_meta[j] = vm.k;
    v_meta[n_groups + j] = vm.log2_center;
    v_meta[2 * n_groups + j] = vm.log2_scale_q;
  }
  return skipped;
}

Moment moment(const float* c, const int* i) {
  // c: log2_max, numerator, inv_expand_min, k_max, fp8 max, min_subnormal; i: expand, keep_nonzero, mantissa bits,
  // min normal exponent, exponent bias
  return Moment{Format{i[2], i[3], i[4], c[4], c[5], 1.0f / c[5]}, i[0] != 0, i[1] != 0, c[0], c[1], c[2], c[3]};
}

}  // namespace

extern "C" {

int coat_max_group() { return kMaxGroup; }

// param_kind: 0 fp32, 1 bf16; grad_kind: 0 fp32, 1 bf16 (fp16 gradients are converted to fp32 by the caller).
int64_t coat_fused_adamw_step(void* param, int param_kind, const void* grad, int grad_kind, uint8_t* m_codes,
                              float* m_meta, uint8_t* v_codes, float* v_meta, const int64_t* starts,
                              const int64_t* lengths, int64_t n_groups, const float* scalars, const float* m_consts,
                              const int* m_ints, const float* v_consts, const int* v_ints, const float* m_table,
                              const float* v_table, int skip_nonfinite, int threads) {
  if (threads > 0) omp_set_num_threads(threads);
  const Scalars h{scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5], scalars[6], scalars[7]};
  const Moment mc = moment(m_consts, m_ints), vc = moment(v_consts, v_ints);
  const bool skip = skip_nonfinite != 0;
  const auto* gf = static_cast<const float*>(grad);
  const auto* gb = static_cast<const uint16_t*>(grad);
  auto* pf = static_cast<float*>(param);
  auto* pb = static_cast<uint16_t*>(param);
  const auto args = [&](auto p, auto g, auto&& run) {
    return run(p, g, m_codes, m_meta, v_codes, v_meta, starts, lengths, n_groups, h, mc, vc, m_table, v_table, skip);
  };
  if (param_kind == 0 && grad_kind == 0) return args(pf, gf, step<F32, F32>);
  if (param_kind == 0) return args(pf, gb, step<F32, BF16>);
  if (grad_kind == 0) return args(pb, gf, step<BF16, F32>);
  return args(pb, gb, step<BF16, BF16>);
}
}
