"""COAT's FP8 layer blocks: autograd functions whose inputs and outputs are BF16 (or fp32) tensors while
everything they save for backward is FP8, with Triton kernels on CUDA and the torch references on CPU
(`ActivationConfig.backend`).

What each block saves (docs/activations.md has the memory accounting):
- fp8_linear: the per-tensor E4M3 transposed copy of x (the weight-gradient GEMM operand), or nothing new with
  reuse_input=True (x itself, when something else keeps it anyway, e.g. the flash attention output); the weight
  is never copied for backward: backward re-casts it transposed with the forward's scale, or takes the cached
  copy of its WeightCache (made once per optimizer step, held by the cache, not by the graph).
- fp8_norm_linear / fp8_add_norm_linear: the norm input (or the residual sum) as E4M3 1x16 + per-row statistics;
  the GEMM input is recomputed from it in backward (same values, same scale).
- fp8_swiglu_linear: gate/up as E4M3 1x16; silu, the product and its FP8 transpose are recomputed in backward.
- fp8_norm_swiglu_mlp: norm -> fc1 -> SwiGLU -> fc2 in one node (what the three above save); backward takes the
  SwiGLU input gradient straight to E5M2 without writing it in BF16.
- fp8_swiglu, fp8_gelu, fp8_silu: their input as E4M3 1x16.
Gradients: the output gradient of every GEMM is quantized to per-tensor E5M2 (row-major for dgrad, transposed
for wgrad); dgrad = E5M2 x E4M3, wgrad = E5M2 x E4M3, fp32 accumulation.
Inf/NaN: a GEMM whose input or output gradient holds Inf/NaN returns all-NaN (its per-tensor scale is NaN); a 1x16
group holding Inf/NaN dequantizes to NaN (only that group); so non-finite values always propagate, never vanish.

Every block takes `config` (ActivationConfig; default: ActivationConfig()) and `runtime` (CoatRuntime: scale
tickets, the gradient-amax hand-off; None: neither) and, per weight, a WeightCache from the runtime (None: the
weight is quantized at every forward).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats import E4M3, E5M2
from . import norm as norm_ops
from . import pointwise, swiglu
from .config import ActivationConfig
from .gemm import check_gemm_dims, fp8_gemm
from .handoff import GradientAmaxHandoff
from .runtime import CoatRuntime
from .scaling import ScaleTickets, finalize_scale
from .tensor_quant import cast, quantize_tensor
from .weights import WeightCache

__all__ = ["fp8_linear", "fp8_norm_linear", "fp8_add_norm_linear", "fp8_norm_swiglu_mlp", "fp8_swiglu",
           "fp8_swiglu_linear", "fp8_gelu", "fp8_silu"]

DEFAULT_CONFIG = ActivationConfig()


class BlockEnv(NamedTuple):
    """What one block call needs of its config and runtime, resolved once per call."""
    use_triton: bool
    fast_accum: bool
    tickets: ScaleTickets | None
    handoff: GradientAmaxHandoff | None


def _env(x, config, runtime) -> BlockEnv:
    config = config or DEFAULT_CONFIG
    return BlockEnv(config.use_triton(x), config.fprop_fast_accum, runtime.tickets if runtime else None,
                    runtime.handoff if runtime else None)


def _cache(cache, config, runtime):
    if cache is None or runtime is None:
        return None
    return runtime.usable_cache(cache, config or DEFAULT_CONFIG)


def _weight_rows(weight, cache, env):
    if cache is not None:
        return cache.rows(weight, env.use_triton, env.tickets)
    w8, _, scale = quantize_tensor(weight.detach(), E4M3, env.use_triton, tickets=env.tickets)
    return w8, scale


def _weight_transposed(weight, scale, cache, env):
    """W^T as E4M3 with the forward's scale: the cache's copy only if it still holds the forward's quantization,
    else re-cast."""
    if cache is not None and cache.holds(weight, scale):
        return cache.transposed(weight, env.use_triton)[0]
    return cast(weight.detach(), scale, E4M3, env.use_triton, write_row=False, write_t=True)[1]


def _out_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _gradient_amax(env, grad):
    return env.handoff.take(grad) if env.handoff is not None else None


def _linear_backward(ctx, dy, weight, w_scale, in_scale, in_t_fn, need_dx):
    """Shared GEMM backward: (dgrad [M, K] | None, wgrad | None, bias grad | None). in_t_fn() -> input^T FP8."""
    env = ctx.env
    need_dw = ctx.needs_input_grad[ctx.weight_index]
    dy2 = dy.reshape(-1, weight.shape[0])
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, env.use_triton, write_row=need_dx, write_t=need_dw,
                                           amax=_gradient_amax(env, dy), tickets=env.tickets)
    dx = dw = db = None
    if need_dx:
        w8_t = _weight_transposed(weight, w_scale, ctx.cache, env)
        dx = fp8_gemm(dy8, w8_t, dy_scale, w_scale, ctx.out_dtype)
    if need_dw:
        dw = fp8_gemm(dy8_t, in_t_fn(), dy_scale, in_scale, weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[ctx.weight_index + 1]:
        db = dy2.float().sum(0).to(ctx.bias_dtype)
    return dx, dw, db


def _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered, env):
    """Forward norm (+ residual add) of x [..., H]: the BF16 sum h, its 1x16 FP8 copy (q, e), row statistics, and the
    per-tensor E4M3 input of the next GEMM (scale, codes)."""
    hdim = x.shape[-1]
    r2 = residual.reshape(-1, hdim) if residual is not None else None
    h, q, e, mean, rstd, amax = norm_ops.norm_forward(x.reshape(-1, hdim), norm_weight, norm_bias, env.use_triton,
                                                      residual=r2, kind=kind, eps=eps, zero_centered=zero_centered,
                                                      tickets=env.tickets)
    y_scale = finalize_scale(amax, E4M3, env.use_triton)
    y8, _ = norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, env.use_triton,
                               zero_centered=zero_centered)
    return h, q, e, mean, rstd, y_scale, y8


def _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres):
    """Norm backward from the saved FP8 copy (+ the residual stream's gradient dres): (dx shaped as the block's
    input, d norm weight, d norm bias) in the parameters' dtypes; dx's amax goes to the block consuming it."""
    env = ctx.env
    hand_off = env.handoff is not None
    out = norm_ops.norm_backward(q, e, mean, rstd, norm_weight, dy_norm, env.use_triton, dres=dres,
                                 has_bias=norm_bias is not None, zero_centered=ctx.zero_centered,
                                 partial_amax=hand_off, tickets=env.tickets)
    dx, dnw, dnb = out[:3]
    dx = dx.reshape(ctx.shape)
    if hand_off:
        env.handoff.give(dx, out[3])
    return dx, dnw.to(norm_weight.dtype), (dnb.to(norm_bias.dtype) if dnb is not None else None)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, reuse_input, env):
        k, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(k, n, "fp8_linear")
        x2 = x.reshape(-1, k)
        x8, x8_t, x_scale = quantize_tensor(x2, E4M3, env.use_triton, write_t=not reuse_input, tickets=env.tickets)
        w8, w_scale = _weight_rows(weight, cache, env)
        ctx.out_dtype, ctx.cache, ctx.reuse_input, ctx.weight_index, ctx.env = _out_dtype(x), cache, reuse_input, 1, env
        ctx.has_bias, ctx.bias_dtype = bias is not None, (bias.dtype if bias is not None else None)
        ctx.save_for_backward(x if reuse_input else x8_t, weight, x_scale, w_scale)
        y = fp8_gemm(x8, w8, x_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        saved_x, weight, x_scale, w_scale = ctx.saved_tensors
        k = weight.shape[1]

        def input_t():
            if ctx.reuse_input:
                return cast(saved_x.reshape(-1, k), x_scale, E4M3, ctx.env.use_triton, write_row=False,
                            write_t=True)[1]
            return saved_x

        dx, dw, db = _linear_backward(ctx, dy, weight, w_scale, x_scale, input_t, ctx.needs_input_grad[0])
        if dx is not None:
            dx = dx.reshape(*dy.shape[:-1], k)
        return dx, dw, db, None, None, None


def fp8_linear(x, weight, bias=None, *, config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
               weight_cache: WeightCache | None = None, reuse_input: bool = False):
    """y = x @ weight.T + bias with E4M3 x E4M3 per-tensor GEMMs. reuse_input=True saves x itself (no new memory
    when x is kept anyway, e.g. the attention output) and re-quantizes it in backward."""
    return _Fp8Linear.apply(x, weight, bias, _cache(weight_cache, config, runtime), reuse_input,
                            _env(x, config, runtime))


class _Fp8NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, weight, bias, cache, kind, eps, zero_centered,
                residual_out, env):
        hdim, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(hdim, n, "fp8_norm_linear")
        h, q, e, mean, rstd, y_scale, y8 = _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps,
                                                        zero_centered, env)
        w8, w_scale = _weight_rows(weight, cache, env)
        ctx.out_dtype, ctx.cache, ctx.weight_index, ctx.zero_centered = _out_dtype(x), cache, 4, zero_centered
        ctx.has_bias, ctx.bias_dtype = bias is not None, (bias.dtype if bias is not None else None)
        ctx.has_residual, ctx.residual_out, ctx.shape, ctx.env = residual is not None, residual_out, x.shape, env
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, weight, y_scale, w_scale)
        out = fp8_gemm(y8, w8, y_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        out = out.reshape(*x.shape[:-1], n)
        if residual is not None:
            return out, h.reshape(x.shape)
        if residual_out:  # x itself, as the residual stream: its gradient joins the norm backward (no add)
            return out, x
        return out

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, weight, y_scale, w_scale = ctx.saved_tensors

        def norm_out_t():
            return norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, ctx.env.use_triton,
                                      zero_centered=ctx.zero_centered, write_row=False, write_t=True)[1]

        need_dx = any(ctx.needs_input_grad[:4])
        dy_norm, dw, db = _linear_backward(ctx, dout, weight, w_scale, y_scale, norm_out_t, need_dx)
        dx = dnw = dnb = None
        if need_dx:
            dres = dh.reshape(q.shape) if ((ctx.has_residual or ctx.residual_out) and dh is not None) else None
            dx, dnw, dnb = _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres)
        return dx, (dx if ctx.has_residual else None), dnw, dnb, dw, db, None, None, None, None, None, None


def fp8_norm_linear(x, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, residual_out: bool = False, config: ActivationConfig | None = None,
                    runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(norm(x)): saves x as E4M3 1x16 (+ row statistics); the GEMM input is recomputed in backward.
    residual_out=True returns (y, x'): x' is x (a view of it) to use as the residual stream; the gradient that
    reaches x' is added to the norm's input gradient inside the norm-backward kernel, instead of autograd adding
    the two gradients of x in a separate pass."""
    return _Fp8NormLinear.apply(x, None, norm_weight, norm_bias, weight, bias, _cache(weight_cache, config, runtime),
                                norm, eps, zero_centered_gamma, residual_out, _env(x, config, runtime))


def fp8_add_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                        zero_centered_gamma=False, config: ActivationConfig | None = None,
                        runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """h = x + residual (BF16), y = linear(norm(h)) -> (y, h). One kernel writes h, its E4M3 1x16 copy (saved) and
    the norm's statistics; backward adds h's incoming gradient inside the norm-backward kernel."""
    return _Fp8NormLinear.apply(x, residual, norm_weight, norm_bias, weight, bias,
                                _cache(weight_cache, config, runtime), norm, eps, zero_centered_gamma, False,
                                _env(x, config, runtime))


class _Fp8SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, env):
        f2, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(f2 // 2, n, "fp8_swiglu_linear")
        q, e, amax, _ = swiglu.swiglu_forward(x.reshape(-1, f2), env.use_triton, tickets=env.tickets)
        p_scale = finalize_scale(amax, E4M3, env.use_triton)
        p8, _ = swiglu.swiglu_cast(q, e, p_scale, env.use_triton)
        w8, w_scale = _weight_rows(weight, cache, env)
        ctx.out_dtype, ctx.cache, ctx.weight_index, ctx.shape, ctx.x_dtype = _out_dtype(x), cache, 1, x.shape, x.dtype
        ctx.has_bias, ctx.bias_dtype, ctx.env = bias is not None, (bias.dtype if bias is not None else None), env
        ctx.save_for_backward(q, e, weight, p_scale, w_scale)
        out = fp8_gemm(p8, w8, p_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dout):
        q, e, weight, p_scale, w_scale = ctx.saved_tensors
        env = ctx.env

        def product_t():
            return swiglu.swiglu_cast(q, e, p_scale, env.use_triton, write_row=False, write_t=True)[1]

        dp, dw, db = _linear_backward(ctx, dout, weight, w_scale, p_scale, product_t, ctx.needs_input_grad[0])
        dx = None
        if dp is not None:
            dx, amax = swiglu.swiglu_backward(q, e, dp, env.use_triton, tickets=env.tickets)
            dx = dx.to(ctx.x_dtype).reshape(ctx.shape)
            if ctx.x_dtype == torch.bfloat16 and env.handoff is not None:
                env.handoff.give(dx, amax)
        return dx, dw, db, None, None


def fp8_swiglu_linear(x, weight, bias=None, *, config: ActivationConfig | None = None,
                      runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(silu(gate) * up), [gate | up] = x.chunk(2, -1): saves gate/up as E4M3 1x16 and recomputes the
    product (and its transposed FP8 copy) in backward."""
    return _Fp8SwigluLinear.apply(x, weight, bias, _cache(weight_cache, config, runtime), _env(x, config, runtime))


class _Fp8Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, env):
        f2 = x.shape[-1]
        q, e, _, y = swiglu.swiglu_forward(x.reshape(-1, f2), env.use_triton, write_out=True, tickets=env.tickets)
        ctx.save_for_backward(q, e)
        ctx.shape, ctx.x_dtype, ctx.env = x.shape, x.dtype, env
        return y.reshape(*x.shape[:-1], f2 // 2)

    @staticmethod
    def backward(ctx, dy):
        q, e = ctx.saved_tensors
        dx, _ = swiglu.swiglu_backward(q, e, dy.reshape(q.shape[0], -1), ctx.env.use_triton, tickets=ctx.env.tickets)
        return dx.to(ctx.x_dtype).reshape(ctx.shape), None


def fp8_swiglu(x, *, config: ActivationConfig | None = None):
    """silu(gate) * up with [gate | up] = x.chunk(2, -1); saves x as E4M3 1x16."""
    return _Fp8Swiglu.apply(x, _env(x, config, None))


class _Fp8Pointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name, use_triton):
        y, q, e = pointwise.act_forward(x, name, use_triton)
        ctx.save_for_backward(q, e)
        ctx.name, ctx.use_triton = name, use_triton
        return y

    @staticmethod
    def backward(ctx, dy):
        q, e = ctx.saved_tensors
        return pointwise.act_backward(q, e, dy, ctx.name, ctx.use_triton), None, None


def fp8_gelu(x, *, config: ActivationConfig | None = None):
    """GELU (erf form); saves x as E4M3 1x16."""
    return _Fp8Pointwise.apply(x, "gelu", (config or DEFAULT_CONFIG).use_triton(x))


def fp8_silu(x, *, config: ActivationConfig | None = None):
    """SiLU; saves x as E4M3 1x16."""
    return _Fp8Pointwise.apply(x, "silu", (config or DEFAULT_CONFIG).use_triton(x))
