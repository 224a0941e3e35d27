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
weight is quantized at every forward). A GEMM weight may be given as a sequence of tensors, row blocks of one weight
(separate q/k/v or gate/up projections keeping their own parameters): one scale for the whole, each block gets its
own gradient. With a usable cache the blocks keep no BF16 weight for backward (the cache holds both FP8 copies).
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
from .weights import WeightCache, WeightPieces, as_pieces

__all__ = ["fp8_linear", "fp8_norm_linear", "fp8_add_norm_linear", "fp8_norm_swiglu_mlp", "fp8_swiglu",
           "fp8_swiglu_linear", "fp8_gelu", "fp8_silu"]

DEFAULT_CONFIG = ActivationConfig()


class BlockEnv(NamedTuple):
    """What one block call needs of its config and runtime, resolved once per call (outside autograd's forward,
    where grad mode is off)."""
    use_triton: bool
    fast_accum: bool
    tickets: ScaleTickets | None
    handoff: GradientAmaxHandoff | None
    grad_enabled: bool  # a backward may follow
    weight_t_in_forward: bool  # weight caches make the transposed copy in forward (else at the first backward)


def _env(x, config, runtime) -> BlockEnv:
    config = config or DEFAULT_CONFIG
    return BlockEnv(config.use_triton(x), config.fprop_fast_accum, runtime.tickets if runtime else None,
                    runtime.handoff if runtime else None, torch.is_grad_enabled(),
                    config.transposed_weights == "forward")


def _cache(cache, config, runtime):
    if cache is None or runtime is None:
        return None
    return runtime.usable_cache(cache, config or DEFAULT_CONFIG)


def _weight_rows(pieces: WeightPieces, cache, env):
    """(w8 [N, K], scale); a cache also makes the transposed copy now when a backward will need it and the config
    says so (transposed_weights="forward")."""
    if cache is not None:
        return cache.fill(pieces, env.use_triton, env.tickets,
                          transposed=env.grad_enabled and env.weight_t_in_forward)
    w8, _, scale = quantize_tensor(pieces.joined(), E4M3, env.use_triton, tickets=env.tickets)
    return w8, scale


def _weight_transposed(cache, like, pieces: WeightPieces | None, scale, use_triton):
    """W^T as E4M3 with the forward's scale: the cache's copy (made now from the saved weight if the forward did not
    make it), or re-cast from the saved weight."""
    if cache is not None:
        if not cache.holds(like, scale):
            raise RuntimeError("coat-fp8: the FP8 weight cache was refilled between this forward and its backward "
                               "(the runtime's clock ticked in between: an optimizer step or clock.tick() before "
                               "backward)")
        if cache.w8_t is None:
            cache.fill(pieces, use_triton, transposed=True)  # holds this quantization: makes only the copy
        return cache.w8_t
    return cast(pieces.joined(), scale, E4M3, use_triton, write_row=False, write_t=True)[1]


class _WeightLike:
    """What a cached block remembers of its weight for backward: shape, dtype, device (not the tensors)."""

    def __init__(self, pieces: WeightPieces):
        self.shape, self.dtype, self.device, self.rows = pieces.shape, pieces.dtype, pieces.device, pieces.rows

    def split(self, grad):
        return tuple(grad.split(self.rows, 0)) if len(self.rows) > 1 else (grad,)


def _keeps_weight(cache, env) -> bool:
    """Whether backward needs the weight itself: without a cache, or when the cache makes the transposed copy in
    backward."""
    return cache is None or not env.weight_t_in_forward


def _keep_weights(ctx, pieces: WeightPieces, cache, env):
    """Tensors to save for the weight: the pieces (parameters, no copies) when backward needs them, else none."""
    ctx.weight_like = _WeightLike(pieces)
    return pieces.tensors if _keeps_weight(cache, env) else ()


def _keep_two_weights(ctx, first: WeightPieces, cache1, second: WeightPieces, cache2, env):
    """_keep_weights for a node with two GEMM weights: (tensors to save, how many belong to the first)."""
    ctx.weight_likes = (_WeightLike(first), _WeightLike(second))
    a = first.tensors if _keeps_weight(cache1, env) else ()
    b = second.tensors if _keeps_weight(cache2, env) else ()
    return a + b, len(a)


def _out_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _gradient_amax(env, grad):
    return env.handoff.take(grad) if env.handoff is not None else None


def _linear_backward(ctx, dy, pieces, w_scale, in_scale, in_t_fn, need_dx, need_dw, need_db):
    """Shared GEMM backward: (dgrad [M, K] | None, wgrad per weight piece | (None, ...), bias grad | None).
    in_t_fn() -> input^T FP8."""
    env, weight = ctx.env, ctx.weight_like
    dy2 = dy.reshape(-1, weight.shape[0])
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, env.use_triton, write_row=need_dx, write_t=need_dw,
                                           amax=_gradient_amax(env, dy), tickets=env.tickets)
    dx = db = None
    dws = (None,) * len(weight.rows)
    if need_dx:
        dx = fp8_gemm(dy8, _weight_transposed(ctx.cache, weight, pieces, w_scale, env.use_triton), dy_scale, w_scale,
                      ctx.out_dtype)
    if need_dw:
        dws = weight.split(fp8_gemm(dy8_t, in_t_fn(), dy_scale, in_scale, weight.dtype))
    if need_db:
        db = dy2.float().sum(0).to(ctx.bias_dtype)
    return dx, dws, db


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
    def forward(ctx, x, bias, cache, reuse_input, env, *weights):
        pieces = WeightPieces(weights)
        k, n = x.shape[-1], pieces.shape[0]
        check_gemm_dims(k, n, "fp8_linear")
        x2 = x.reshape(-1, k)
        x8, x8_t, x_scale = quantize_tensor(x2, E4M3, env.use_triton, write_t=not reuse_input, tickets=env.tickets)
        w8, w_scale = _weight_rows(pieces, cache, env)
        ctx.out_dtype, ctx.cache, ctx.reuse_input, ctx.env = _out_dtype(x), cache, reuse_input, env
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x if reuse_input else x8_t, x_scale, w_scale, *_keep_weights(ctx, pieces, cache, env))
        y = fp8_gemm(x8, w8, x_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        saved_x, x_scale, w_scale, *weights = ctx.saved_tensors
        k = ctx.weight_like.shape[1]

        def input_t():
            if ctx.reuse_input:
                return cast(saved_x.reshape(-1, k), x_scale, E4M3, ctx.env.use_triton, write_row=False,
                            write_t=True)[1]
            return saved_x

        need = ctx.needs_input_grad
        dx, dws, db = _linear_backward(ctx, dy, WeightPieces(weights) if weights else None, w_scale, x_scale,
                                       input_t, need[0], any(need[5:]), ctx.bias_dtype is not None and need[1])
        if dx is not None:
            dx = dx.reshape(*dy.shape[:-1], k)
        return (dx, db, None, None, None) + dws


def fp8_linear(x, weight, bias=None, *, config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
               weight_cache: WeightCache | None = None, reuse_input: bool = False):
    """y = x @ weight.T + bias with E4M3 x E4M3 per-tensor GEMMs (weight: a tensor or row blocks of one).
    reuse_input=True saves x itself (no new memory when x is kept anyway, e.g. the attention output) and
    re-quantizes it in backward."""
    return _Fp8Linear.apply(x, bias, _cache(weight_cache, config, runtime), reuse_input, _env(x, config, runtime),
                            *as_pieces(weight).tensors)


class _Fp8NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, bias, cache, kind, eps, zero_centered, residual_out, env,
                *weights):
        pieces = WeightPieces(weights)
        hdim, n = x.shape[-1], pieces.shape[0]
        check_gemm_dims(hdim, n, "fp8_norm_linear")
        h, q, e, mean, rstd, y_scale, y8 = _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps,
                                                        zero_centered, env)
        w8, w_scale = _weight_rows(pieces, cache, env)
        ctx.out_dtype, ctx.cache, ctx.zero_centered, ctx.env = _out_dtype(x), cache, zero_centered, env
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.has_residual, ctx.residual_out, ctx.shape = residual is not None, residual_out, x.shape
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale,
                              *_keep_weights(ctx, pieces, cache, env))
        out = fp8_gemm(y8, w8, y_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        out = out.reshape(*x.shape[:-1], n)
        if residual is not None:
            return out, h.reshape(x.shape)
        if residual_out:  # x itself, as the residual stream: its gradient joins the norm backward (no add)
            return out, x
        return out

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, *weights = ctx.saved_tensors

        def norm_out_t():
            return norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, ctx.env.use_triton,
                                      zero_centered=ctx.zero_centered, write_row=False, write_t=True)[1]

        need = ctx.needs_input_grad
        need_dx = any(need[:4])
        dy_norm, dws, db = _linear_backward(ctx, dout, WeightPieces(weights) if weights else None, w_scale, y_scale,
                                            norm_out_t, need_dx, any(need[11:]),
                                            ctx.bias_dtype is not None and need[4])
        dx = dnw = dnb = None
        if need_dx:
            dres = dh.reshape(q.shape) if ((ctx.has_residual or ctx.residual_out) and dh is not None) else None
            dx, dnw, dnb = _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres)
        return (dx, (dx if ctx.has_residual else None), dnw, dnb, db, None, None, None, None, None, None) + dws


def fp8_norm_linear(x, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, residual_out: bool = False, config: ActivationConfig | None = None,
                    runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(norm(x)): saves x as E4M3 1x16 (+ row statistics); the GEMM input is recomputed in backward.
    residual_out=True returns (y, x'): x' is x (a view of it) to use as the residual stream; the gradient that
    reaches x' is added to the norm's input gradient inside the norm-backward kernel, instead of autograd adding
    the two gradients of x in a separate pass."""
    return _Fp8NormLinear.apply(x, None, norm_weight, norm_bias, bias, _cache(weight_cache, config, runtime), norm, eps,
                                zero_centered_gamma, residual_out, _env(x, config, runtime), *as_pieces(weight).tensors)


def fp8_add_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                        zero_centered_gamma=False, config: ActivationConfig | None = None,
                        runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """h = x + residual (BF16), y = linear(norm(h)) -> (y, h). One kernel writes h, its E4M3 1x16 copy (saved) and
    the norm's statistics; backward adds h's incoming gradient inside the norm-backward kernel."""
    return _Fp8NormLinear.apply(x, residual, norm_weight, norm_bias, bias, _cache(weight_cache, config, runtime), norm,
                                eps, zero_centered_gamma, False, _env(x, config, runtime), *as_pieces(weight).tensors)


class _Fp8SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, cache, env, *weights):
        pieces = WeightPieces(weights)
        f2, n = x.shape[-1], pieces.shape[0]
        check_gemm_dims(f2 // 2, n, "fp8_swiglu_linear")
        q, e, amax, _ = swiglu.swiglu_forward(x.reshape(-1, f2), env.use_triton, tickets=env.tickets)
        p_scale = finalize_scale(amax, E4M3, env.use_triton)
        p8, _ = swiglu.swiglu_cast(q, e, p_scale, env.use_triton)
        w8, w_scale = _weight_rows(pieces, cache, env)
        ctx.out_dtype, ctx.cache, ctx.shape, ctx.x_dtype, ctx.env = _out_dtype(x), cache, x.shape, x.dtype, env
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(q, e, p_scale, w_scale, *_keep_weights(ctx, pieces, cache, env))
        out = fp8_gemm(p8, w8, p_scale, w_scale, ctx.out_dtype, bias, fast_accum=env.fast_accum)
        return out.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dout):
        q, e, p_scale, w_scale, *weights = ctx.saved_tensors
        env = ctx.env

        def product_t():
            return swiglu.swiglu_cast(q, e, p_scale, env.use_triton, write_row=False, write_t=True)[1]

        need = ctx.needs_input_grad
        dp, dws, db = _linear_backward(ctx, dout, WeightPieces(weights) if weights else None, w_scale, p_scale,
                                       product_t, need[0], any(need[4:]), ctx.bias_dtype is not None and need[1])
        dx = None
        if dp is not None:
            dx, amax = swiglu.swiglu_backward(q, e, dp, env.use_triton, tickets=env.tickets)
            dx = dx.to(ctx.x_dtype).reshape(ctx.shape)
            if ctx.x_dtype == torch.bfloat16 and env.handoff is not None:
                env.handoff.give(dx, amax)
        return (dx, db, None, None) + dws


def fp8_swiglu_linear(x, weight, bias=None, *, config: ActivationConfig | None = None,
                      runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(silu(gate) * up), [gate | up] = x.chunk(2, -1): saves gate/up as E4M3 1x16 and recomputes the
    product (and its transposed FP8 copy) in backward."""
    return _Fp8SwigluLinear.apply(x, bias, _cache(weight_cache, config, runtime), _env(x, config, runtime),
                                  *as_pieces(weight).tensors)


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
