// The fused COAT Lion step on the CPU, bit-exact with coat_kernels.optim.momentum_reference.fused_lion_step (and so
// with the Triton kernel of coat_kernels.optim.lion_triton): per quantization group, dequantize the FP8 momentum,
// Lion, re-quantize with Dynamic Range Expansion; groups whose new momentum is not finite keep everything. The same
// fp32 operation sequence as the reference (fused multiply-adds exactly where it writes pm.fma; built with
// -ffp-contract=off), on the primitives of dre_cpu.h. Groups run in parallel (OpenMP); the loops over a group's
// elements are plain fp32 code the compiler vectorizes.
#include "dre_cpu.h"

namespace {

struct LionScalars { float decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2; };

// One group: returns 1 when it is skipped (its new momentum is not finite), else writes it and returns 0.
template <typename PT, typename GT>
int lion_group(typename PT::T* param, const typename GT::T* grad, uint8_t* codes, float* meta, int64_t s, int len,
               int64_t j, int64_t n_groups, const LionScalars& h, const Moment& mc, const float* table) {
  float log2_codes[kMaxGroup], m[kMaxGroup];
  lookup(codes + s, len, table, log2_codes);
  const float inv_k = 1.0f / meta[j];
  const float bias = (meta[2 * n_groups + j] - mc.log2_max) * inv_k + meta[n_groups + j];
  int nonfinite = 0;
  float big = 0.0f, small = INFINITY;
#pragma omp simd reduction(| : nonfinite) reduction(max : big) reduction(min : small)
  for (int i = 0; i < len; ++i) {
    float mi = exp2_p(std::fma(log2_codes[i], inv_k, bias), false);
    mi = codes[s + i] >= 128 ? 0.0f - mi : mi;
    const float g = GT::load(grad[s + i]);
    const float c = std::fma(mi, h.beta1, g * h.one_minus_beta1);
    const float direction = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
    log2_codes[i] = direction;  // reused: the update's sign
    mi = std::fma(mi, h.beta2, g * h.one_minus_beta2);
    m[i] = mi;
    const float am = std::fabs(mi);
    nonfinite |= am <= 3.40282347e+38f ? 0 : 1;  // NaN or Inf
    big = am > big ? am : big;
    small = am >= kMinNormal && am < small ? am : small;
  }
  if (nonfinite != 0) return 1;  // the group keeps its parameters, codes and metadata
  typename PT::T* p = param + s;
#pragma omp simd
  for (int i = 0; i < len; ++i)
    PT::store_param(p, nullptr, i, std::fma(-h.lr, log2_codes[i], PT::load_param(p, nullptr, i) * h.decay));
  const Meta mm = group_params(big, small, mc);
  encode(m, codes + s, len, mm, mc);
  meta[j] = mm.k;
  meta[n_groups + j] = mm.log2_center;
  meta[2 * n_groups + j] = mm.log2_scale_q;
  return 0;
}

template <typename PT, typename GT>
int64_t lion_step(typename PT::T* param, const typename GT::T* grad, uint8_t* codes, float* meta,
                  const int64_t* starts, const int64_t* lengths, int64_t n_groups, const LionScalars h,
                  const Moment mc, const float* table) {
  int64_t skipped = 0;
#pragma omp parallel for schedule(static) reduction(+ : skipped)
  for (int64_t j = 0; j < n_groups; ++j)
    skipped += lion_group<PT, GT>(param, grad, codes, meta, starts[j], static_cast<int>(lengths[j]), j, n_groups, h,
                                  mc, table);
  return skipped;
}

}  // namespace

extern "C" {

int coat_max_group() { return kMaxGroup; }

// param_kind: 0 fp32, 1 bf16; grad_kind: 0 fp32, 1 bf16 (fp16 gradients are converted to fp32 by the caller).
// scalars: decay (1 - lr * weight_decay), lr, beta1, 1 - beta1, beta2, 1 - beta2. Returns the skipped groups.
int64_t coat_fused_lion_step(void* param, int param_kind, const void* grad, int grad_kind, uint8_t* codes,
                             float* meta, const int64_t* starts, const int64_t* lengths, int64_t n_groups,
                             const float* scalars, const float* consts, const int* ints, const float* table,
                             int threads) {
  if (threads > 0) omp_set_num_threads(threads);
  const LionScalars h{scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5]};
  const Moment mc = moment(consts, ints);
  const auto* gf = static_cast<const float*>(grad);
  const auto* gb = static_cast<const uint16_t*>(grad);
  auto* pf = static_cast<float*>(param);
  auto* pb = static_cast<uint16_t*>(param);
  if (param_kind == 0 && grad_kind == 0) return lion_step<F32, F32>(pf, gf, codes, meta, starts, lengths, n_groups,
                                                                    h, mc, table);
  if (param_kind == 0) return lion_step<F32, BF16>(pf, gb, codes, meta, starts, lengths, n_groups, h, mc, table);
  if (grad_kind == 0) return lion_step<BF16, F32>(pb, gf, codes, meta, starts, lengths, n_groups, h, mc, table);
  return lion_step<BF16, BF16>(pb, gb, codes, meta, starts, lengths, n_groups, h, mc, table);
}
}
