// The fused COAT AdamW step on the CPU, bit-exact with coat_kernels.optim.dre_reference.fused_adamw_step (and so
// with the Triton/Gluon kernel): per quantization group, dequantize both FP8 moments, AdamW, re-quantize with Dynamic
// Range Expansion; groups whose new second moment is not finite keep everything. The same fp32 operation sequence as
// the reference: IEEE division and square root, fused multiply-adds exactly where the reference writes pm.fma
// (std::fma; built with -ffp-contract=off so that nothing else is fused), portable_math's log2/exp2 polynomials, and
// round-to-nearest-even, saturating FP8 encodings. Groups run in parallel (OpenMP).
// Two implementations of the same operations: a portable one (step_group: per group, plain fp32 loops the compiler
// vectorizes), and, where the compiler targets AVX-512 with VBMI (F, BW, DQ, VBMI), one written with intrinsics
// (step_fast) that handles the common groups and hands the others to step_group. Defining COAT_PORTABLE builds the
// portable one alone. bf16 parameters with master remainders (param kind 2) are stepped as the fp32 master
// (parameter, remainder) of coat_kernels.optim.master_remainders, read and written with its integer operations.
// Shared primitives (encodings, polynomials, element types): dre_cpu.h.
#include "dre_cpu.h"
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VBMI__) && \
    !defined(COAT_PORTABLE)
#define COAT_FAST_PATH 1
#endif

namespace {

struct Scalars { float decay, step_size, inv_bc2_sqrt, eps, beta1, one_minus_beta1, beta2, one_minus_beta2; };

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
inline void update_params(typename PT::T* param, uint16_t* rem, const float* m, const float* v, int len,
                          const Scalars& h) {
#pragma omp simd
  for (int i = 0; i < len; ++i) {
    const float denom = std::fma(std::sqrt(v[i]), h.inv_bc2_sqrt, h.eps);
    PT::store_param(param, rem, i, std::fma(-h.step_size, m[i] / denom, PT::load_param(param, rem, i) * h.decay));
  }
}

// One group of the step, element by element (the portable path, and the fast path's fallback for its rare groups):
// returns 1 when the group is skipped (its new second moment is not finite), else writes it and returns 0.
template <typename PT, typename GT>
inline int step_group(typename PT::T* param, uint16_t* rem, const typename GT::T* grad, uint8_t* m_codes, float* m_meta,
                      uint8_t* v_codes, float* v_meta, int64_t s, int len, int64_t j, int64_t n_groups,
                      const Scalars& h, const Moment& mc, const Moment& vc, const float* m_table,
                      const float* v_table, bool skip_nonfinite) {
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
  if (x.nonfinite != 0 && skip_nonfinite) return 1;  // the group keeps its parameters, codes and metadata
  update_params<PT>(param + s, shifted(rem, s), m, v, len, h);
  const Meta mm = group_params(x.m_big, x.m_small, mc), vm = group_params(x.v_big, x.v_small, vc);
  encode(m, m_codes + s, len, mm, mc);
  encode(v, v_codes + s, len, vm, vc);
  m_meta[j] = mm.k;
  m_meta[n_groups + j] = mm.log2_center;
  m_meta[2 * n_groups + j] = mm.log2_scale_q;
  v_meta[j] = vm.k;
  v_meta[n_groups + j] = vm.log2_center;
  v_meta[2 * n_groups + j] = vm.log2_scale_q;
  return 0;
}

#if defined(COAT_FAST_PATH)
// The AVX-512 path: the same operations on 16 elements at a time, written with intrinsics; where an instruction gives
// the identical bits in fewer operations than the portable formulas, it is used (each substitution is explained
// where it is made). Groups are processed in batches of kBatch: (A) per group, decode both moments, update them with
// the gradient and reduce their extremes per lane, into a per-thread scratch that stays in L1; (B) the metadata of
// the batch's groups, one group per vector lane; (C) per group, the parameters' update and the encoding of both
// moments from the scratch. Groups the path does not cover go through step_group: a decoder that may saturate (or a
// k that is not positive), a non-finite new moment, magnitudes of 2^126 or more, k > kFastMaxK.

#define COAT_INLINE inline __attribute__((always_inline))
constexpr int kBatch = 16;
constexpr float kFastMaxK = 64.0f;  // bounds the encoder's log2 errors times k (see group_params16)
constexpr float kFastMaxMagnitude = 8.50705917302346158658e+37f;  // 2^126

struct FastMoment {  // a moment's constants, as vectors
  __m512i plane[4][2];  // byte j of the fp32 log2 table of the codes, entries 0..63 and 64..127
  __m512i round_bias, odd_bit, shift, subnormal_below;
  __m512 max, min_subnormal, inv_min_subnormal;
  bool keep_nonzero;
};

inline FastMoment fast_moment(const Moment& c, const float* table) {
  FastMoment f;
  alignas(64) uint8_t bytes[4][128];
  for (int i = 0; i < 128; ++i) {
    const uint32_t b = bits_of(table[i]);
    for (int p = 0; p < 4; ++p) bytes[p][i] = static_cast<uint8_t>(b >> (8 * p));
  }
  for (int p = 0; p < 4; ++p) {
    f.plane[p][0] = _mm512_load_si512(bytes[p]);
    f.plane[p][1] = _mm512_load_si512(bytes[p] + 64);
  }
  const int M = c.fmt.mantissa_bits, bias = c.fmt.bias;
  // fp8_magnitude_code's normal branch with the re-biasing folded into the rounding constant (it never borrows
  // there: those magnitudes are at least 2^(1 - bias) > 2^-bias)
  f.round_bias = _mm512_set1_epi32(static_cast<int>(((1u << (22 - M)) - 1u) - (static_cast<uint32_t>(127 - bias) << 23)));
  f.odd_bit = _mm512_set1_epi32(1 << (23 - M));
  f.shift = _mm512_set1_epi32(23 - M);
  f.subnormal_below = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(127 + c.fmt.min_normal_exp) << 23));
  f.max = _mm512_set1_ps(c.fmt.max);
  f.min_subnormal = _mm512_set1_ps(c.fmt.min_subnormal);
  f.inv_min_subnormal = _mm512_set1_ps(c.fmt.inv_min_subnormal);
  f.keep_nonzero = c.keep_nonzero;
  return f;
}

// The byte j of 64 codes' log2 entries are looked up with one two-register byte permute each (VPERMI2B uses the
// index's low 7 bits: the sign bit is ignored, as the table's halves are equal), then interleaved into fp32 lanes by
// two rounds of unpacks. The unpacks work within 128-bit lanes, so the codes are first permuted such that the four
// results hold elements 0-15, 16-31, 32-47 and 48-63 in order.
COAT_INLINE void lookup64(__m512i codes, const __m512i (&plane)[4][2], __m512 out[4]) {
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
      52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
      44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i idx = _mm512_permutexvar_epi8(_mm512_load_si512(order), codes);
  const __m512i b0 = _mm512_permutex2var_epi8(plane[0][0], idx, plane[0][1]);
  const __m512i b1 = _mm512_permutex2var_epi8(plane[1][0], idx, plane[1][1]);
  const __m512i b2 = _mm512_permutex2var_epi8(plane[2][0], idx, plane[2][1]);
  const __m512i b3 = _mm512_permutex2var_epi8(plane[3][0], idx, plane[3][1]);
  const __m512i lo01 = _mm512_unpacklo_epi8(b0, b1), hi01 = _mm512_unpackhi_epi8(b0, b1);
  const __m512i lo23 = _mm512_unpacklo_epi8(b2, b3), hi23 = _mm512_unpackhi_epi8(b2, b3);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

template <typename GT>
COAT_INLINE __m512 load_grad16(const typename GT::T* g, __mmask16 k);
template <>
COAT_INLINE __m512 load_grad16<F32>(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }
template <>
COAT_INLINE __m512 load_grad16<BF16>(const uint16_t* g, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, g)), 16));
}

template <typename PT>
COAT_INLINE __m512 load_param16(const typename PT::T* p, const uint16_t* r, __mmask16 k);
template <>
COAT_INLINE __m512 load_param16<F32>(const float* p, const uint16_t*, __mmask16 k) {
  return _mm512_maskz_loadu_ps(k, p);
}
template <>
COAT_INLINE __m512 load_param16<BF16>(const uint16_t* p, const uint16_t*, __mmask16 k) {
  return load_grad16<BF16>(p, k);
}
// the masters of a bf16 parameter's high halves hi and remainders lo (join_master on 16 lanes)
COAT_INLINE __mmask16 rounded_up16(__m512i hi, __m512i lo) {
  return _mm512_cmpge_epu32_mask(lo, _mm512_set1_epi32(0x8000)) &
         _mm512_cmpneq_epi32_mask(_mm512_and_si512(hi, _mm512_set1_epi32(0x7FFF)), _mm512_set1_epi32(0x7FFF));
}
template <>
COAT_INLINE __m512 load_param16<BF16R>(const uint16_t* p, const uint16_t* r, __mmask16 k) {
  __m512i hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, r));
  hi = _mm512_mask_sub_epi32(hi, rounded_up16(hi, lo), hi, _mm512_set1_epi32(1));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(hi, 16), lo));
}

template <typename PT>
COAT_INLINE void store_param16(typename PT::T* p, uint16_t* r, __mmask16 k, __m512 x);
template <>
COAT_INLINE void store_param16<F32>(float* p, uint16_t*, __mmask16 k, __m512 x) { _mm512_mask_storeu_ps(p, k, x); }
template <>
COAT_INLINE void store_param16<BF16R>(uint16_t* p, uint16_t* r, __mmask16 k, __m512 x) {  // split_master on 16 lanes
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lo = _mm512_and_si512(u, _mm512_set1_epi32(0xFFFF));
  __m512i hi = _mm512_srli_epi32(u, 16);
  hi = _mm512_mask_add_epi32(hi, rounded_up16(hi, lo), hi, _mm512_set1_epi32(1));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(hi));
  _mm256_mask_storeu_epi16(r, k, _mm512_cvtepi32_epi16(lo));
}
template <>
COAT_INLINE void store_param16<BF16>(uint16_t* p, uint16_t*, __mmask16 k, __m512 x) {  // float_to_bf16 on 16 lanes
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_fpclass_ps_mask(x, 0x81);  // QNaN or SNaN
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
}

// (A) for one group: the new moments into m, v (scratch), and per lane their extremes: the largest magnitude (its
// bits: NaN lanes, whose bits exceed every other magnitude's, show there), the smallest magnitude of at least
// 2^-126, and whether a lane held a zero or subnormal (tiny).
struct FastExtremes {
  __m512 m_big, v_big, m_small, v_small;
  __mmask16 m_tiny, v_tiny;
};

// exp2_unsaturated of the decoder's exponents y = log2|code| / k + bias: f = y - round(y) by VREDUCEPS (exact, ties
// to even: what adding and subtracting 1.5 * 2^23 gives), round(y) = y - f (exact), p * 2^n by VSCALEFPS (one
// correctly rounded product, as p times the fp32 2^n, for the n in [-126, 127] of these groups); then 0 - x for
// negative codes. Lanes with y < -126 are zeroed: BYTE_ZERO, every nonzero code of the group decodes to at least
// 2^-126 (its smallest code's exponent is >= -126), so those are the codes +-0, read from the bytes (nonzero);
// otherwise by comparing y (NaN passes).

template <bool BYTE_ZERO>
COAT_INLINE __m512 decode16(__m512 log2_code, __m512 inv_k, __m512 bias, __mmask16 nonzero, __mmask16 negative) {
  const __m512 y = _mm512_fmadd_ps(log2_code, inv_k, bias);
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(y, f);
  __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(0x1.3d1086p-7f), f, _mm512_set1_ps(0x1.ca1d18p-5f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.ebf906p-3f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.62e0c2p-1f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.000002p+0f));
  const __mmask16 keep = BYTE_ZERO ? nonzero : _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  const __m512 x = _mm512_maskz_scalef_ps(keep, r, n);
  return _mm512_mask_sub_ps(x, negative, _mm512_setzero_ps(), x);  // 0 - x, as the reference
}

template <typename GT, bool BYTE_ZERO>
COAT_INLINE FastExtremes update_group(const typename GT::T* grad, const uint8_t* m_codes, const uint8_t* v_codes, int len,
                                 const Scalars& h, const FastMoment& mf, const FastMoment& vf, float m_inv_k,
                                 float m_bias, float v_inv_k, float v_bias, float* m, float* v) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 mik = _mm512_set1_ps(m_inv_k), mb = _mm512_set1_ps(m_bias);
  const __m512 vik = _mm512_set1_ps(v_inv_k), vb = _mm512_set1_ps(v_bias);
  const __m512 beta1 = _mm512_set1_ps(h.beta1), omb1 = _mm512_set1_ps(h.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(h.beta2), omb2 = _mm512_set1_ps(h.one_minus_beta2);
  const __m512i sign_bit = _mm512_set1_epi8(static_cast<char>(0x80)), magnitude = _mm512_set1_epi8(0x7F);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  FastExtremes x{zero, zero, _mm512_set1_ps(INFINITY), _mm512_set1_ps(INFINITY), 0, 0};
  for (int c = 0; c < len; c += 64) {
    const int n = len - c < 64 ? len - c : 64;
    const __mmask64 kb = n == 64 ? ~0ULL : (1ULL << n) - 1;
    const __m512i mraw = _mm512_maskz_loadu_epi8(kb, m_codes + c), vraw = _mm512_maskz_loadu_epi8(kb, v_codes + c);
    const __mmask64 mneg = _mm512_test_epi8_mask(mraw, sign_bit), vneg = _mm512_test_epi8_mask(vraw, sign_bit);
    const __mmask64 mnz = BYTE_ZERO ? _mm512_test_epi8_mask(mraw, magnitude) : 0;
    const __mmask64 vnz = BYTE_ZERO ? _mm512_test_epi8_mask(vraw, magnitude) : 0;
    __m512 ml[4], vl[4];
    lookup64(mraw, mf.plane, ml);
    lookup64(vraw, vf.plane, vl);
    for (int q = 0; q < 4 && 16 * q < n; ++q) {
      const int nq = n - 16 * q;
      const __mmask16 kv = nq >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nq) - 1);
      __m512 mi = decode16<BYTE_ZERO>(ml[q], mik, mb, static_cast<__mmask16>(mnz >> (16 * q)),
                                      static_cast<__mmask16>(mneg >> (16 * q)));
      __m512 vi = decode16<BYTE_ZERO>(vl[q], vik, vb, static_cast<__mmask16>(vnz >> (16 * q)),
                                      static_cast<__mmask16>(vneg >> (16 * q)));
      const __m512 g = load_grad16<GT>(grad + c + 16 * q, kv);
      mi = _mm512_fmadd_ps(mi, beta1, _mm512_mul_ps(g, omb1));
      vi = _mm512_fmadd_ps(vi, beta2, _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
      _mm512_store_ps(m + c + 16 * q, mi);
      _mm512_store_ps(v + c + 16 * q, vi);
      // VRANGEPS 0x0A: the smaller magnitude, sign cleared
      const __mmask16 mt = _mm512_mask_fpclass_ps_mask(kv, mi, 0x26), vt = _mm512_mask_fpclass_ps_mask(kv, vi, 0x26);
      x.m_big = _mm512_castsi512_ps(_mm512_mask_max_epu32(_mm512_castps_si512(x.m_big), kv, _mm512_castps_si512(x.m_big),
                                                          _mm512_and_si512(_mm512_castps_si512(mi), abs_mask)));
      x.v_big = _mm512_castsi512_ps(_mm512_mask_max_epu32(_mm512_castps_si512(x.v_big), kv, _mm512_castps_si512(x.v_big),
                                                          _mm512_and_si512(_mm512_castps_si512(vi), abs_mask)));
      x.m_small = _mm512_mask_range_ps(x.m_small, kv & ~mt, x.m_small, mi, 0x0A);
      x.v_small = _mm512_mask_range_ps(x.v_small, kv & ~vt, x.v_small, vi, 0x0A);
      x.m_tiny |= mt;
      x.v_tiny |= vt;
    }
  }
  return x;
}

// dre_reference.encode of up to 16 * W values at xs (whole vectors are read; the first n are stored) into codes q.
// The W vectors go through each step together: the steps are long chains of dependent operations, and W
// independent chains keep the vector units busy.
// log2: adding 0x4AFB0C to the bits carries into the exponent exactly when the mantissa exceeds sqrt(2)'s (the
// fold), so VGETEXPPS of the sum is the folded exponent, and the sum's mantissa bits plus 0x3F3504F4 are the folded
// mantissa (1.m or 1.m / 2) as fp32 bits. exp2: as decode16 with the degree-3 polynomial (the exponents stay below
// log2(fp8 max) + 1: see group_params16).
// GENERAL: lanes may be zero or subnormal (log2 = -inf in the reference) or have exponents below -126 (both give
// y = 0), y may lie below the smallest subnormal (raised to it when KEEP_NONZERO) or round above the format's
// largest value (clamped). Otherwise group_params16 has checked that the group has no such lanes, and y != 0
// everywhere.
// FP8 rounding (fp8_magnitude_code): the normal branch rounds the bits to nearest even in integer arithmetic, the
// subnormal one rounds y / min_subnormal to an integer by adding 1.5 * 2^23 (one fused operation: the product is
// exact). The codes' sign bits are added after packing them to bytes: a negative x whose y is not zero.
#define FOR_W for (int w = 0; w < W; ++w)
template <bool GENERAL, bool KEEP_NONZERO, int W>
COAT_INLINE void encode_block(const float* xs, uint8_t* q, int n, __m512 k, __m512 neg_offset, const FastMoment& f) {
  static_assert(W % 2 == 0, "codes are packed in pairs of vectors");
  alignas(64) static const uint8_t low_bytes[64] = {
      0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104,
      108, 112, 116, 120, 124, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0, 0, 0, 0};
  __m512 x[W], t[W], l[W], z[W], y[W], r[W];
  __m512i u[W], code[W];
  __mmask16 negative[W], tiny[W], valid[W];
  FOR_W x[w] = _mm512_load_ps(xs + 16 * w);
  FOR_W u[w] = _mm512_add_epi32(_mm512_castps_si512(x[w]), _mm512_set1_epi32(0x4AFB0C));
  FOR_W t[w] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(_mm512_and_si512(u[w], _mm512_set1_epi32(0x7FFFFF)),
                                                                 _mm512_set1_epi32(0x3F3504F4))),
                             _mm512_set1_ps(1.0f));
  FOR_W l[w] = _mm512_fmadd_ps(_mm512_set1_ps(-0x1.51ffc4p-2f), t[w], _mm512_set1_ps(0x1.09889ep-1f));
  FOR_W l[w] = _mm512_fmadd_ps(l[w], t[w], _mm512_set1_ps(-0x1.732d04p-1f));
  FOR_W l[w] = _mm512_fmadd_ps(l[w], t[w], _mm512_set1_ps(0x1.710fcep+0f));
  FOR_W l[w] = _mm512_fmadd_ps(t[w], l[w], _mm512_getexp_ps(_mm512_castsi512_ps(u[w])));
  FOR_W z[w] = _mm512_fmadd_ps(k, l[w], neg_offset);
  FOR_W t[w] = _mm512_reduce_ps(z[w], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // f = z - round(z)
  FOR_W r[w] = _mm512_sub_ps(z[w], t[w]);                                               // round(z)
  FOR_W y[w] = _mm512_fmadd_ps(_mm512_set1_ps(0x1.c34958p-5f), t[w], _mm512_set1_ps(0x1.f0da64p-3f));
  FOR_W y[w] = _mm512_fmadd_ps(y[w], t[w], _mm512_set1_ps(0x1.62f51ap-1f));
  FOR_W y[w] = _mm512_fmadd_ps(y[w], t[w], _mm512_set1_ps(0x1.fff6b0p-1f));
  if (GENERAL) {
    FOR_W tiny[w] = _mm512_fpclass_ps_mask(x[w], 0x26);  // +-0, subnormal
    FOR_W valid[w] = _mm512_mask_cmp_ps_mask(static_cast<__mmask16>(~tiny[w]), z[w], _mm512_set1_ps(-126.0f),
                                             _CMP_NLT_UQ);
  }
  FOR_W y[w] = GENERAL ? _mm512_maskz_scalef_ps(valid[w], y[w], r[w]) : _mm512_scalef_ps(y[w], r[w]);
  if (GENERAL && KEEP_NONZERO)
    FOR_W y[w] = _mm512_mask_max_ps(y[w], static_cast<__mmask16>(~tiny[w]), y[w], f.min_subnormal);
  FOR_W negative[w] = GENERAL ? _mm512_mask_cmp_ps_mask(KEEP_NONZERO ? static_cast<__mmask16>(~tiny[w]) : valid[w],
                                                        x[w], _mm512_setzero_ps(), _CMP_LT_OQ)
                              : _mm512_movepi32_mask(_mm512_castps_si512(x[w]));
  if (GENERAL) FOR_W y[w] = _mm512_min_ps(y[w], f.max);
  FOR_W code[w] = _mm512_add_epi32(_mm512_castps_si512(y[w]), f.round_bias);
  FOR_W code[w] = _mm512_mask_add_epi32(code[w], _mm512_test_epi32_mask(_mm512_castps_si512(y[w]), f.odd_bit),
                                        code[w], _mm512_set1_epi32(1));
  FOR_W code[w] = _mm512_srlv_epi32(code[w], f.shift);
  FOR_W code[w] = _mm512_mask_sub_epi32(
      code[w], _mm512_cmplt_epu32_mask(_mm512_castps_si512(y[w]), f.subnormal_below),
      _mm512_castps_si512(_mm512_fmadd_ps(y[w], f.inv_min_subnormal, _mm512_set1_ps(12582912.0f))),
      _mm512_set1_epi32(0x4B400000));
  for (int w = 0; w < W; w += 2) {
    __m256i codes = _mm512_castsi512_si256(_mm512_permutex2var_epi8(code[w], _mm512_load_si512(low_bytes), code[w + 1]));
    codes = _mm256_mask_add_epi8(codes, _mm512_kunpackw(negative[w + 1], negative[w]), codes,
                                 _mm256_set1_epi8(static_cast<char>(0x80)));
    const int left = n - 16 * w;
    if (left >= 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * w), codes);
    } else {
      if (left > 0) _mm256_mask_storeu_epi8(q + 16 * w, (1u << left) - 1, codes);
    }
  }
}

template <bool GENERAL, bool KEEP_NONZERO>
COAT_INLINE void encode_group_fast(const float* x, uint8_t* q, int len, float k, float offset, const FastMoment& f) {
  const __m512 kv = _mm512_set1_ps(k), neg_offset = _mm512_set1_ps(-offset);
  for (int i = 0; i < len; i += 128)
    encode_block<GENERAL, KEEP_NONZERO, 8>(x + i, q + i, len - i, kv, neg_offset, f);
}

COAT_INLINE void encode_fast(const float* x, uint8_t* q, int len, float k, float offset, bool general,
                        const FastMoment& f) {
  if (!general)
    encode_group_fast<false, false>(x, q, len, k, offset, f);
  else if (f.keep_nonzero)
    encode_group_fast<true, true>(x, q, len, k, offset, f);
  else
    encode_group_fast<true, false>(x, q, len, k, offset, f);
}

// (C) for one group: AdamW's parameter update, then both moments' codes.
template <typename PT>
COAT_INLINE void write_group(typename PT::T* param, uint16_t* rem, uint8_t* m_codes, uint8_t* v_codes, int len,
                             const Scalars& h,
                        const float* m, const float* v, float m_k, float m_offset, bool m_general, float v_k,
                        float v_offset, bool v_general, const FastMoment& mf, const FastMoment& vf) {
  const __m512 inv_bc2 = _mm512_set1_ps(h.inv_bc2_sqrt), eps = _mm512_set1_ps(h.eps);
  const __m512 neg_step = _mm512_set1_ps(-h.step_size), decay = _mm512_set1_ps(h.decay);
  for (int i = 0; i < len; i += 16) {
    const __mmask16 kv = len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1);
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(_mm512_load_ps(v + i)), inv_bc2, eps);
    const __m512 p = load_param16<PT>(param + i, shifted(rem, i), kv);
    store_param16<PT>(param + i, shifted(rem, i), kv,
                      _mm512_fmadd_ps(neg_step, _mm512_div_ps(_mm512_load_ps(m + i), denom), _mm512_mul_ps(p, decay)));
  }
  encode_fast(m, m_codes, len, m_k, m_offset, m_general, mf);
  encode_fast(v, v_codes, len, v_k, v_offset, v_general, vf);
}

// portable_math.log2 on 16 lanes, the formulas of log2_p (degree 4, or 3 if COARSE).
template <bool COARSE>
inline __m512 log2_16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i mant = _mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF)), _mm512_set1_epi32(0x3F800000));
  const __mmask16 fold = _mm512_cmpgt_epu32_mask(mant, _mm512_set1_epi32(0x3FB504F3));
  mant = _mm512_mask_sub_epi32(mant, fold, mant, _mm512_set1_epi32(0x00800000));
  __m512i exponent = _mm512_mask_add_epi32(_mm512_srli_epi32(bits, 23), fold, _mm512_srli_epi32(bits, 23),
                                           _mm512_set1_epi32(1));
  exponent = _mm512_add_epi32(exponent, _mm512_set1_epi32(0x4B000000 + 129));
  const __m512 e = _mm512_sub_ps(_mm512_castsi512_ps(exponent), _mm512_set1_ps(8388864.0f));
  const __m512 f = _mm512_sub_ps(_mm512_castsi512_ps(mant), _mm512_set1_ps(1.0f));
  __m512 r;
  if (COARSE) {
    r = _mm512_fmadd_ps(_mm512_set1_ps(-0x1.51ffc4p-2f), f, _mm512_set1_ps(0x1.09889ep-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(-0x1.732d04p-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.710fcep+0f));
  } else {
    r = _mm512_fmadd_ps(_mm512_set1_ps(0x1.05ce42p-2f), f, _mm512_set1_ps(-0x1.9083a2p-2f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.f0dc10p-2f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(-0x1.70eac0p-1f));
    r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0x1.71515ap+0f));
  }
  r = _mm512_fmadd_ps(f, r, e);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kMinNormal), _CMP_GE_OQ),
                              _mm512_set1_ps(-INFINITY), r);
}

struct FastMeta {
  __m512 k, log2_center, log2_scale_q, offset;
  __mmask16 general;  // groups whose encoding needs encode_block's GENERAL lanes
};

// group_params of 16 groups, the encoder's offset (log2 sQ - log2 Q) + k log2 c, and which groups need the general
// encoder. The encoder's exponent z = k log2|x| - offset of the group's smallest (largest) nonzero magnitude bounds
// every lane's from below (above) up to k times the coarse log2's error on both sides (2 * 1.2e-4), at most 0.016
// for k <= kFastMaxK. So a group without zeros or subnormals whose smallest z is at least -126 + 1/16 (KEEP_NONZERO:
// log2(smallest subnormal) + 1/16) has no lane with y = 0 (or y below the smallest subnormal), and one whose largest
// z is at most log2 Q + 1/64 has none that rounds above Q (the next FP8 magnitude's midpoint lies log2(1 + 2^-M / 3.5)
// > 1/20 above log2 Q; exp2's relative error 7.7e-5 is far below); the exponents stay below 127.5, where the encoder's
// 2^n is the fp32 one.
inline FastMeta group_params16(__m512 big, __m512 small, __mmask16 tiny, const Moment& c) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(big, _mm512_set1_ps(kMinNormal), _CMP_GE_OQ);
  const __m512 log2_big = log2_16<false>(_mm512_mask_blend_ps(nonzero, one, big));
  const __m512 log2_small = log2_16<false>(_mm512_mask_blend_ps(nonzero, one, small));
  FastMeta m;
  if (c.expand) {
    const __m512 log2_ratio = _mm512_sub_ps(log2_big, log2_small);
    const __m512 iem = _mm512_set1_ps(c.inv_expand_min);
    __m512 k = _mm512_roundscale_ps(_mm512_div_ps(_mm512_set1_ps(c.numerator), log2_ratio),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    k = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(k, iem), iem), _mm512_set1_ps(c.k_max));
    m.k = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(log2_ratio, _mm512_set1_ps(kLog2RatioEps), _CMP_LE_OQ), k, one);
    m.log2_center = _mm512_mul_ps(_mm512_add_ps(log2_big, log2_small), _mm512_set1_ps(0.5f));
  } else {
    m.k = one;
    m.log2_center = _mm512_setzero_ps();
  }
  m.log2_scale_q = _mm512_mul_ps(m.k, _mm512_sub_ps(log2_big, m.log2_center));
  m.offset = _mm512_add_ps(_mm512_sub_ps(m.log2_scale_q, _mm512_set1_ps(c.log2_max)),
                           _mm512_mul_ps(m.k, m.log2_center));
  const __m512 z_small = _mm512_fmsub_ps(m.k, log2_16<true>(small), m.offset);
  const __m512 z_big = _mm512_fmsub_ps(m.k, log2_16<true>(big), m.offset);
  m.general = static_cast<__mmask16>(
      tiny | ~nonzero |
      _mm512_cmp_ps_mask(z_small, _mm512_set1_ps(c.keep_nonzero ? std::log2(c.fmt.min_subnormal) + 0.0625f
                                                                 : -126.0f + 0.0625f), _CMP_NGE_UQ) |
      _mm512_cmp_ps_mask(z_big, _mm512_set1_ps(c.log2_max + 0.015625f), _CMP_NLE_UQ));
  return m;
}

// Per lane g of the result: the largest (MAX: of the lanes' bits as unsigned integers) or smallest (fp32) lane of
// x[g], for 16 vectors.
template <bool MAX>
inline __m512 reduce16x16(const __m512* x) {
  const auto op = [](__m512 a, __m512 b) {
    return MAX ? _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
               : _mm512_min_ps(a, b);
  };
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: x[2i]'s halves combined, 8-15: x[2i+1]'s
    a[i] = op(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane l: group 4i + l's four partial results
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within 128-bit lanes
    c[i] = op(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 d = op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  // d's 128-bit lane l holds, in order, groups l, 4 + l, 8 + l, 12 + l: put group g in lane g
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}

template <typename PT, typename GT>
int64_t step_fast(typename PT::T* param, uint16_t* rem, const typename GT::T* grad, uint8_t* m_codes, float* m_meta,
                  uint8_t* v_codes, float* v_meta, const int64_t* starts, const int64_t* lengths, int64_t n_groups,
                  const Scalars h, const Moment mc, const Moment vc, const float* m_table, const float* v_table,
                  bool skip_nonfinite) {
  const FastMoment mf = fast_moment(mc, m_table), vf = fast_moment(vc, v_table);
  const int64_t n_batches = (n_groups + kBatch - 1) / kBatch;
  int64_t skipped = 0;
#pragma omp parallel reduction(+ : skipped)
  {
    // per thread: the batch's new moments, each group's at a multiple of 64 elements, the second moments' after
    // kScratch floats (encode_block reads up to 127 floats past a group's end)
    constexpr int kScratch = kBatch * kMaxGroup + 128;
    float* scratch = static_cast<float*>(aligned_alloc(64, sizeof(float) * 2 * kScratch));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n_batches; ++b) {
      const int64_t j0 = b * kBatch;
      const int nb = static_cast<int>(n_groups - j0 < kBatch ? n_groups - j0 : kBatch);
      const __mmask16 kb = static_cast<__mmask16>((1u << nb) - 1);
      // the decoders' constants of the batch's groups (step_group's formulas)
      alignas(64) float m_inv_k[kBatch], m_bias[kBatch], v_inv_k[kBatch], v_bias[kBatch];
      __mmask16 slow, byte_zero;
      {
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 mk = _mm512_mask_loadu_ps(one, kb, m_meta + j0), vk = _mm512_mask_loadu_ps(one, kb, v_meta + j0);
        const __m512 mik = _mm512_div_ps(one, mk), vik = _mm512_div_ps(one, vk);
        const __m512 mb = _mm512_add_ps(
            _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(kb, m_meta + 2 * n_groups + j0),
                                        _mm512_set1_ps(mc.log2_max)), mik),
            _mm512_maskz_loadu_ps(kb, m_meta + n_groups + j0));
        const __m512 vb = _mm512_add_ps(
            _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(kb, v_meta + 2 * n_groups + j0),
                                        _mm512_set1_ps(vc.log2_max)), vik),
            _mm512_maskz_loadu_ps(kb, v_meta + n_groups + j0));
        _mm512_store_ps(m_inv_k, mik);
        _mm512_store_ps(m_bias, mb);
        _mm512_store_ps(v_inv_k, vik);
        _mm512_store_ps(v_bias, vb);
        // groups whose decoder may saturate (its largest code's exponent, or NaN) or whose k is not positive go
        // through step_group
        const __m512 top = _mm512_set1_ps(127.0f);
        slow = _mm512_cmp_ps_mask(_mm512_fmadd_ps(_mm512_set1_ps(mc.log2_max), mik, mb), top, _CMP_NLT_UQ) |
               _mm512_cmp_ps_mask(_mm512_fmadd_ps(_mm512_set1_ps(vc.log2_max), vik, vb), top, _CMP_NLT_UQ) |
               _mm512_cmp_ps_mask(mk, _mm512_setzero_ps(), _CMP_NGT_UQ) |
               _mm512_cmp_ps_mask(vk, _mm512_setzero_ps(), _CMP_NGT_UQ);
        // the smallest nonzero code (entry 1) decodes to 2^-126 or more
        const __m512 bottom = _mm512_set1_ps(-126.0f);
        byte_zero =
            _mm512_cmp_ps_mask(_mm512_fmadd_ps(_mm512_set1_ps(m_table[1]), mik, mb), bottom, _CMP_GE_OQ) &
            _mm512_cmp_ps_mask(_mm512_fmadd_ps(_mm512_set1_ps(v_table[1]), vik, vb), bottom, _CMP_GE_OQ);
      }
      slow &= kb;
      __m512 m_big[kBatch], v_big[kBatch], m_small[kBatch], v_small[kBatch];
      __mmask16 m_tiny = 0, v_tiny = 0;
      int offset[kBatch];
      int at = 0;
      for (int g = 0; g < kBatch; ++g) {
        m_big[g] = v_big[g] = _mm512_setzero_ps();
        m_small[g] = v_small[g] = _mm512_set1_ps(INFINITY);
        if (g >= nb || (slow >> g & 1)) continue;
        const int64_t s = starts[j0 + g];
        const int len = static_cast<int>(lengths[j0 + g]);
        offset[g] = at;
        const FastExtremes x =
            (byte_zero >> g & 1)
                ? update_group<GT, true>(grad + s, m_codes + s, v_codes + s, len, h, mf, vf, m_inv_k[g], m_bias[g],
                                         v_inv_k[g], v_bias[g], scratch + at, scratch + kScratch + at)
                : update_group<GT, false>(grad + s, m_codes + s, v_codes + s, len, h, mf, vf, m_inv_k[g], m_bias[g],
                                          v_inv_k[g], v_bias[g], scratch + at, scratch + kScratch + at);
        m_big[g] = x.m_big;
        v_big[g] = x.v_big;
        m_small[g] = x.m_small;
        v_small[g] = x.v_small;
        m_tiny |= static_cast<__mmask16>((x.m_tiny != 0) << g);
        v_tiny |= static_cast<__mmask16>((x.v_tiny != 0) << g);
        at += (len + 63) & ~63;
      }
      // the largest magnitudes' bits are reduced as integers: NaN lanes (bits above +inf's) are not lost
      const __m512 mbig = reduce16x16<true>(m_big), vbig = reduce16x16<true>(v_big);
      const FastMeta mm = group_params16(mbig, reduce16x16<false>(m_small), m_tiny, mc);
      const FastMeta vm = group_params16(vbig, reduce16x16<false>(v_small), v_tiny, vc);
      // the groups this path encodes: finite moments below 2^126 (NaN compares false), k <= kFastMaxK
      const __m512 limit = _mm512_set1_ps(kFastMaxMagnitude), max_k = _mm512_set1_ps(kFastMaxK);
      const __mmask16 fast = static_cast<__mmask16>(
          kb & ~slow & _mm512_cmp_ps_mask(mbig, limit, _CMP_LT_OQ) &
          _mm512_cmp_ps_mask(vbig, limit, _CMP_LT_OQ) & _mm512_cmp_ps_mask(mm.k, max_k, _CMP_LE_OQ) &
          _mm512_cmp_ps_mask(vm.k, max_k, _CMP_LE_OQ));
      _mm512_mask_storeu_ps(m_meta + j0, fast, mm.k);
      _mm512_mask_storeu_ps(m_meta + n_groups + j0, fast, mm.log2_center);
      _mm512_mask_storeu_ps(m_meta + 2 * n_groups + j0, fast, mm.log2_scale_q);
      _mm512_mask_storeu_ps(v_meta + j0, fast, vm.k);
      _mm512_mask_storeu_ps(v_meta + n_groups + j0, fast, vm.log2_center);
      _mm512_mask_storeu_ps(v_meta + 2 * n_groups + j0, fast, vm.log2_scale_q);
      alignas(64) float mk[kBatch], mo[kBatch], vk[kBatch], vo[kBatch];
      _mm512_store_ps(mk, mm.k);
      _mm512_store_ps(mo, mm.offset);
      _mm512_store_ps(vk, vm.k);
      _mm512_store_ps(vo, vm.offset);
      for (int g = 0; g < nb; ++g) {
        const int64_t j = j0 + g, s = starts[j];
        const int len = static_cast<int>(lengths[j]);
        if (!(fast >> g & 1)) {
          skipped += step_group<PT, GT>(param, rem, grad, m_codes, m_meta, v_codes, v_meta, s, len, j, n_groups, h,
                                        mc, vc, m_table, v_table, skip_nonfinite);
          continue;
        }
        write_group<PT>(param + s, shifted(rem, s), m_codes + s, v_codes + s, len, h, scratch + offset[g],
                        scratch + kScratch + offset[g], mk[g], mo[g], mm.general >> g & 1, vk[g], vo[g],
                        vm.general >> g & 1, mf, vf);
      }
    }
    free(scratch);
  }
  return skipped;
}
#endif

template <typename PT, typename GT>
int64_t step(typename PT::T* param, uint16_t* rem, const typename GT::T* grad, uint8_t* m_codes, float* m_meta,
             uint8_t* v_codes,
             float* v_meta, const int64_t* starts, const int64_t* lengths, int64_t n_groups, const Scalars h,
             const Moment mc, const Moment vc, const float* m_table, const float* v_table, bool skip_nonfinite) {
#if defined(COAT_FAST_PATH)
  return step_fast<PT, GT>(param, rem, grad, m_codes, m_meta, v_codes, v_meta, starts, lengths, n_groups, h, mc, vc,
                           m_table, v_table, skip_nonfinite);
#else
  int64_t skipped = 0;
#pragma omp parallel for schedule(static) reduction(+ : skipped)
  for (int64_t j = 0; j < n_groups; ++j)
    skipped += step_group<PT, GT>(param, rem, grad, m_codes, m_meta, v_codes, v_meta, starts[j],
                                  static_cast<int>(lengths[j]), j, n_groups, h, mc, vc, m_table, v_table,
                                  skip_nonfinite);
  return skipped;
#endif
}

}  // namespace

extern "C" {

int coat_max_group() { return kMaxGroup; }

// 1 where the library was built with the AVX-512 path (step_fast), 0 for the portable one alone.
int coat_fast_path() {
#if defined(COAT_FAST_PATH)
  return 1;
#else
  return 0;
#endif
}

// param_kind: 0 fp32, 1 bf16, 2 bf16 with master remainders (int16, param's numel); grad_kind: 0 fp32, 1 bf16 (fp16
// gradients are converted to fp32 by the caller).
int64_t coat_fused_adamw_step(void* param, int param_kind, void* remainder, const void* grad, int grad_kind,
                              uint8_t* m_codes,
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
  auto* rem = param_kind == 2 ? static_cast<uint16_t*>(remainder) : nullptr;
  const auto args = [&](auto p, auto g, auto&& run) {
    return run(p, rem, g, m_codes, m_meta, v_codes, v_meta, starts, lengths, n_groups, h, mc, vc, m_table, v_table,
               skip);
  };
  if (param_kind == 2) return grad_kind == 0 ? args(pb, gf, step<BF16R, F32>) : args(pb, gb, step<BF16R, BF16>);
  if (param_kind == 0 && grad_kind == 0) return args(pf, gf, step<F32, F32>);
  if (param_kind == 0) return args(pf, gb, step<F32, BF16>);
  if (grad_kind == 0) return args(pb, gf, step<BF16, F32>);
  return args(pb, gb, step<BF16, BF16>);
}
}
