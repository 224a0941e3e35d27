"""The FP8 blocks as `torch.library` custom ops: the path `torch.compile` takes.

Under `torch.compiler.is_compiling()` each public block of `functional`, `fused_mlp` and `rope` calls the function of
the same name here instead of its autograd Function. Dynamo and AOTAutograd see one opaque op per block forward
(namespace "coat") and one per block backward, each with a fake implementation (exact output shapes, dtypes and
strides, the FP8 tensors saved for backward included), tied together by `torch.library.register_autograd`; they
never trace into autograd Functions, Triton launchers or the runtime's Python state.

The ops take tensors and plain values only, so nothing of a `CoatRuntime` crosses into them:
- no weight cache: the forward op quantizes its weights, the backward op re-casts the transposed copy from the
  weight with the forward's scale (eager's path with cache_weights=False);
- no gradient-amax hand-off: each backward quantizes its output gradient with an amax pass of its own;
- no shared scale tickets: kernels that finish their own scale get a fresh zeroed word pair (scaling.stage_two_args).
The values are those of the eager blocks: a cached weight is the same quantization, and a handed-off amax is the
amax of the same tensor, so a compiled model computes the eager model's bits wherever the same kernels run.

An output a block does not produce (the residual stream without a residual, LayerNorm's mean for RMSNorm, the input
copy of fp8_linear with reuse_input, a gradient nobody needs) is an empty uint8 tensor (custom ops return tensors
only; an integer tensor is never differentiable).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..formats import E4M3, E5M2
from . import norm as norm_ops
from . import pointwise, swiglu
from .block_parts import DEFAULT_CONFIG, BlockEnv, norm_to_fp8, output_dtype, swiglu_mlp_backward, weight_rows
from .gemm import check_gemm_dims, fp8_gemm
from .group_quant import SCALE_DTYPE
from .rope import QKVLayout, _launch as rope_launch, rope_reference
from .scaling import finalize_scale
from .tensor_quant import cast, quantize_tensor
from .tiles import GROUP, pad16
from .weights import WeightPieces, as_pieces

NORMS = ("rmsnorm", "layernorm")


# ----------------------------------------------------------------------------------------------------- helpers
def _env(use_triton: bool, fast_accum: bool = False) -> BlockEnv:
    """A block environment without runtime state (no tickets, no hand-off, no cache)."""
    return BlockEnv(use_triton, fast_accum, None, None, False, False)


def _absent(like: Tensor) -> Tensor:
    """An output the call does not produce: an empty uint8 tensor on like's device."""
    return like.new_empty(0, dtype=torch.uint8)


def _absents(like: Tensor, n: int) -> list:
    """n absent outputs: distinct tensors (the outputs of a custom op may not alias each other)."""
    return [_absent(like) for _ in range(n)]


def _rows(like: Tensor) -> int:
    """The number of rows of like [..., K] seen as [M, K]."""
    m = 1
    for d in like.shape[:-1]:
        m = m * d
    return m


def _fp8(like: Tensor, *shape, fmt=E4M3) -> Tensor:
    return like.new_empty(shape, dtype=fmt.dtype)


def _scale(like: Tensor) -> Tensor:
    return like.new_empty((), dtype=torch.float32)


def _joined(weights) -> Tensor:
    return WeightPieces(weights).joined()


def _weight_t(weights, scale, use_triton) -> Tensor:
    """W^T as E4M3 with the forward's scale (the dgrad operand), from the weight itself."""
    return cast(_joined(weights), scale, E4M3, use_triton, write_row=False, write_t=True)[1]


def _split(grad: Tensor, weights) -> list:
    return list(grad.split([w.shape[0] for w in weights], 0)) if len(weights) > 1 else [grad]


def _keep_grads(ctx):
    """Non-differentiable FP8 outputs get no gradient tensors (None, not materialized zeros)."""
    ctx.set_materialize_grads(False)


def _grad_or_zeros(grad, shape, dtype, like):
    return grad if grad is not None else torch.zeros(shape, dtype=dtype, device=like.device)


def _gemm_backward(dy2, weights, w_scale, in_t_fn, in_scale, need_dx, need_dw, bias_dtype, use_triton):
    """dgrad [M, K] (or absent), wgrad [N, K] (or absent), bias gradient (or absent) of a GEMM y2 = in @ W^T."""
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, use_triton, write_row=need_dx, write_t=need_dw)
    dx, dw, db = _absents(dy2, 3)
    if need_dx:
        dx = fp8_gemm(dy8, _weight_t(weights, w_scale, use_triton), dy_scale, w_scale, dy2.dtype)
    if need_dw:
        dw = fp8_gemm(dy8_t, in_t_fn(), dy_scale, in_scale, weights[0].dtype)
    if bias_dtype is not None:
        db = dy2.float().sum(0).to(bias_dtype)
    return dx, dw, db


def _check_norm(norm, hdim):
    if norm not in NORMS:
        raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    if hdim % GROUP:
        raise ValueError(f"hidden size must be a multiple of {GROUP} (1x16 groups), got {hdim}")


# ------------------------------------------------------------------------------------------------- fp8_linear
@torch.library.custom_op("coat::fp8_linear", mutates_args=())
def _linear(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], reuse_input: bool, use_triton: bool,
            fast_accum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (y, x^T as E4M3 [K, pad16(M)] (absent with reuse_input), x's scale, the weight's scale)."""
    k = x.shape[-1]
    x8, x8_t, x_scale = quantize_tensor(x.reshape(-1, k), E4M3, use_triton, write_t=not reuse_input)
    w8, w_scale = weight_rows(WeightPieces(weights), None, _env(use_triton))
    y = fp8_gemm(x8, w8, x_scale, w_scale, output_dtype(x), bias, fast_accum=fast_accum)
    return y.reshape(*x.shape[:-1], w8.shape[0]), (x8_t if x8_t is not None else _absent(x)), x_scale, w_scale


@_linear.register_fake
def _(x, weights, bias, reuse_input, use_triton, fast_accum):
    k, n = x.shape[-1], sum(w.shape[0] for w in weights)
    x8_t = _absent(x) if reuse_input else _fp8(x, k, pad16(_rows(x)))
    return x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x)), x8_t, _scale(x), _scale(x)


@torch.library.custom_op("coat::fp8_linear_backward", mutates_args=())
def _linear_backward(dy: Tensor, saved_x: Tensor, x_scale: Tensor, w_scale: Tensor, weights: list[Tensor],
                     reuse_input: bool, need_dx: bool, need_dw: bool, bias_dtype: Optional[torch.dtype],
                     use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx [M, K], dW [N, K], d bias), each absent when not asked for."""
    k = weights[0].shape[1]

    def input_t():
        if reuse_input:
            return cast(saved_x.reshape(-1, k), x_scale, E4M3, use_triton, write_row=False, write_t=True)[1]
        return saved_x

    return _gemm_backward(dy.reshape(-1, dy.shape[-1]), weights, w_scale, input_t, x_scale, need_dx, need_dw,
                          bias_dtype, use_triton)


@_linear_backward.register_fake
def _(dy, saved_x, x_scale, w_scale, weights, reuse_input, need_dx, need_dw, bias_dtype, use_triton):
    return _gemm_grads_fake(dy, weights, need_dx, need_dw, bias_dtype)


def _gemm_grads_fake(dy, weights, need_dx, need_dw, bias_dtype):
    """Fake (dgrad, wgrad, bias gradient) of _gemm_backward."""
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    dx = dy.new_empty(_rows(dy), k) if need_dx else _absent(dy)
    dw = weights[0].new_empty(n, k) if need_dw else _absent(dy)
    db = dy.new_empty(n, dtype=bias_dtype) if bias_dtype is not None else _absent(dy)
    return dx, dw, db


def _linear_setup(ctx, inputs, output):
    x, weights, bias, reuse_input, use_triton, _ = inputs
    _, x8_t, x_scale, w_scale = output
    ctx.mark_non_differentiable(x8_t, x_scale, w_scale)
    _keep_grads(ctx)
    ctx.save_for_backward(x if reuse_input else x8_t, x_scale, w_scale, *weights)
    ctx.reuse_input, ctx.use_triton, ctx.x_shape = reuse_input, use_triton, x.shape
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _linear_grads(ctx, dy, *_):
    saved_x, x_scale, w_scale, *weights = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dx, need_dw = need[0], any(need[1])
    bias_dtype = ctx.bias_dtype if need[2] else None
    dx, dw, db = _linear_backward(dy, saved_x, x_scale, w_scale, weights, ctx.reuse_input, need_dx, need_dw,
                                  bias_dtype, ctx.use_triton)
    return (dx.reshape(ctx.x_shape) if need_dx else None, _split(dw, weights) if need_dw else [None] * len(weights),
            db if bias_dtype is not None else None, None, None, None)


_linear.register_autograd(_linear_grads, setup_context=_linear_setup)


def fp8_linear(x, weight, bias=None, config=None, reuse_input=False):
    """functional.fp8_linear on the custom ops."""
    config = config or DEFAULT_CONFIG
    weights = list(as_pieces(weight).tensors)
    check_gemm_dims(x.shape[-1], sum(w.shape[0] for w in weights), "fp8_linear")
    return _linear(x, weights, bias, reuse_input, config.use_triton(x), config.fprop_fast_accum)[0]


# ------------------------------------------------------------------------------ fp8_norm_linear (+ residual add)
@torch.library.custom_op("coat::fp8_norm_linear", mutates_args=())
def _norm_linear(x: Tensor, residual: Optional[Tensor], norm_weight: Tensor, norm_bias: Optional[Tensor],
                 weights: list[Tensor], bias: Optional[Tensor], norm: str, eps: float, zero_centered: bool,
                 residual_out: bool, use_triton: bool, fast_accum: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (out, h, q, e, mean, rstd, the GEMM input's scale, the weight's scale). h: x + residual, or with
    residual_out a copy of x (an op's output cannot be its input; the copy carries the residual stream's gradient
    into this block's norm backward, where eager adds it); else absent. mean: absent for RMSNorm."""
    env = _env(use_triton, fast_accum)
    h, q, e, mean, rstd, y_scale, y8 = norm_to_fp8(x, residual, norm_weight, norm_bias, norm, eps, zero_centered,
                                                    env)
    w8, w_scale = weight_rows(WeightPieces(weights), None, env)
    out = fp8_gemm(y8, w8, y_scale, w_scale, output_dtype(x), bias, fast_accum=fast_accum)
    if residual is not None:
        h = h.reshape(x.shape)
    else:
        h = x.clone(memory_format=torch.contiguous_format) if residual_out else _absent(x)
    return (out.reshape(*x.shape[:-1], w8.shape[0]), h, q, e, mean if mean is not None else _absent(x), rstd,
            y_scale, w_scale)


def _norm_outputs_fake(x, residual, norm, with_h):
    """(h, q, e, mean, rstd) of a fake norm forward."""
    hdim, m = x.shape[-1], _rows(x)
    if residual is not None:
        h = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    else:
        h = x.new_empty(x.shape) if with_h else _absent(x)
    mean = x.new_empty(m, dtype=torch.float32) if norm == "layernorm" else _absent(x)
    return (h, _fp8(x, m, hdim), x.new_empty(m, hdim // GROUP, dtype=SCALE_DTYPE), mean,
            x.new_empty(m, dtype=torch.float32))


@_norm_linear.register_fake
def _(x, residual, norm_weight, norm_bias, weights, bias, norm, eps, zero_centered, residual_out, use_triton,
      fast_accum):
    n = sum(w.shape[0] for w in weights)
    out = x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x))
    return (out, *_norm_outputs_fake(x, residual, norm, residual_out), _scale(x), _scale(x))


@torch.library.custom_op("coat::fp8_norm_linear_backward", mutates_args=())
def _norm_linear_backward(dout: Tensor, dres: Optional[Tensor], q: Tensor, e: Tensor, mean: Optional[Tensor],
                          rstd: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], y_scale: Tensor,
                          w_scale: Tensor, weights: list[Tensor], zero_centered: bool, need_dx: bool, need_dw: bool,
                          bias_dtype: Optional[torch.dtype], use_triton: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dx [M, H] (+ dres), d norm weight, d norm bias, dW, d bias); dx and the norm's gradients come together
    (need_dx), each absent when not asked for."""
    def norm_out_t():
        return norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, use_triton,
                                  zero_centered=zero_centered, write_row=False, write_t=True)[1]

    dy_norm, dw, db = _gemm_backward(dout.reshape(-1, dout.shape[-1]), weights, w_scale, norm_out_t, y_scale,
                                     need_dx, need_dw, bias_dtype, use_triton)
    dx, dnw, dnb = _absents(dout, 3)
    if need_dx:
        dx, dnw, dnb = _norm_grads(q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres, zero_centered,
                                   use_triton)
    return dx, dnw, dnb, dw, db


def _norm_grads(q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres, zero_centered, use_triton):
    dx, dnw, dnb = norm_ops.norm_backward(q, e, mean, rstd, norm_weight, dy_norm, use_triton,
                                          dres=dres.reshape(q.shape) if dres is not None else None,
                                          has_bias=norm_bias is not None, zero_centered=zero_centered)
    return dx, dnw.to(norm_weight.dtype), (dnb.to(norm_bias.dtype) if dnb is not None else _absent(dx))


def _norm_grads_fake(q, norm_weight, norm_bias, dx_dtype, need_dx):
    if not need_dx:
        return _absent(q), _absent(q), _absent(q)
    return (q.new_empty(q.shape, dtype=dx_dtype), norm_weight.new_empty(norm_weight.shape),
            norm_bias.new_empty(norm_bias.shape) if norm_bias is not None else _absent(q))


@_norm_linear_backward.register_fake
def _(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, weights, zero_centered, need_dx,
      need_dw, bias_dtype, use_triton):
    _, dw, db = _gemm_grads_fake(dout, weights, False, need_dw, bias_dtype)
    return (*_norm_grads_fake(q, norm_weight, norm_bias, dout.dtype, need_dx), dw, db)


def _norm_linear_setup(ctx, inputs, output):
    x, residual, norm_weight, norm_bias, weights, bias, norm, _, zero_centered, _, use_triton, _ = inputs
    out, _, q, e, mean, rstd, y_scale, w_scale = output
    ctx.mark_non_differentiable(q, e, mean, rstd, y_scale, w_scale)
    _keep_grads(ctx)
    ctx.save_for_backward(q, e, mean if norm == "layernorm" else None, rstd, norm_weight, norm_bias, y_scale,
                          w_scale, *weights)
    ctx.has_residual, ctx.zero_centered, ctx.use_triton = residual is not None, zero_centered, use_triton
    ctx.x_shape, ctx.out_shape, ctx.out_dtype = x.shape, out.shape, out.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _norm_linear_grads(ctx, dout, dh, *_):
    q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, *weights = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dx, need_dw = any(need[:4]), any(need[4])
    bias_dtype = ctx.bias_dtype if need[5] else None
    dout = _grad_or_zeros(dout, ctx.out_shape, ctx.out_dtype, q)
    dx, dnw, dnb, dw, db = _norm_linear_backward(dout, dh, q, e, mean, rstd, norm_weight, norm_bias, y_scale,
                                                 w_scale, weights, ctx.zero_centered, need_dx, need_dw, bias_dtype,
                                                 ctx.use_triton)
    if need_dx:
        dx = dx.reshape(ctx.x_shape)
    else:
        dx = dnw = dnb = None
    return (dx, dx if ctx.has_residual else None, dnw, dnb if norm_bias is not None else None,
            _split(dw, weights) if need_dw else [None] * len(weights), db if bias_dtype is not None else None,
            None, None, None, None, None, None)


_norm_linear.register_autograd(_norm_linear_grads, setup_context=_norm_linear_setup)


def fp8_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, residual_out=False, config=None):
    """functional.fp8_norm_linear (residual None) and fp8_add_norm_linear on the custom ops."""
    config = config or DEFAULT_CONFIG
    weights = list(as_pieces(weight).tensors)
    _check_norm(norm, x.shape[-1])
    check_gemm_dims(x.shape[-1], sum(w.shape[0] for w in weights), "fp8_norm_linear")
    out, h, *_ = _norm_linear(x, residual, norm_weight, norm_bias, weights, bias, norm, float(eps),
                              zero_centered_gamma, residual_out, config.use_triton(x), config.fprop_fast_accum)
    return (out, h) if residual is not None or residual_out else out


# -------------------------------------------------------------------------------------------- fp8_swiglu_linear
@torch.library.custom_op("coat::fp8_swiglu_linear", mutates_args=())
def _swiglu_linear(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], use_triton: bool, fast_accum: bool
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (out, gate/up as E4M3 1x16 (codes, scales), the product's scale, the weight's scale)."""
    f2 = x.shape[-1]
    q, e, amax, _ = swiglu.swiglu_forward(x.reshape(-1, f2), use_triton)
    p_scale = finalize_scale(amax, E4M3, use_triton)
    p8, _ = swiglu.swiglu_cast(q, e, p_scale, use_triton)
    w8, w_scale = weight_rows(WeightPieces(weights), None, _env(use_triton))
    out = fp8_gemm(p8, w8, p_scale, w_scale, output_dtype(x), bias, fast_accum=fast_accum)
    return out.reshape(*x.shape[:-1], w8.shape[0]), q, e, p_scale, w_scale


def _swiglu_saved_fake(x):
    m, f2 = _rows(x), x.shape[-1]
    return _fp8(x, m, f2), x.new_empty(m, f2 // GROUP, dtype=SCALE_DTYPE)


@_swiglu_linear.register_fake
def _(x, weights, bias, use_triton, fast_accum):
    n = sum(w.shape[0] for w in weights)
    return (x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x)), *_swiglu_saved_fake(x), _scale(x), _scale(x))


@torch.library.custom_op("coat::fp8_swiglu_linear_backward", mutates_args=())
def _swiglu_linear_backward(dout: Tensor, q: Tensor, e: Tensor, p_scale: Tensor, w_scale: Tensor,
                            weights: list[Tensor], need_dx: bool, need_dw: bool, bias_dtype: Optional[torch.dtype],
                            x_dtype: torch.dtype, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (d[gate | up] [M, 2F] in x's dtype, dW, d bias), each absent when not asked for."""
    def product_t():
        return swiglu.swiglu_cast(q, e, p_scale, use_triton, write_row=False, write_t=True)[1]

    dp, dw, db = _gemm_backward(dout.reshape(-1, dout.shape[-1]), weights, w_scale, product_t, p_scale, need_dx,
                                need_dw, bias_dtype, use_triton)
    dx = swiglu.swiglu_backward(q, e, dp, use_triton)[0].to(x_dtype) if need_dx else _absent(dout)
    return dx, dw, db


@_swiglu_linear_backward.register_fake
def _(dout, q, e, p_scale, w_scale, weights, need_dx, need_dw, bias_dtype, x_dtype, use_triton):
    _, dw, db = _gemm_grads_fake(dout, weights, False, need_dw, bias_dtype)
    return (q.new_empty(q.shape, dtype=x_dtype) if need_dx else _absent(dout)), dw, db


def _swiglu_linear_setup(ctx, inputs, output):
    x, weights, bias, use_triton, _ = inputs
    _, q, e, p_scale, w_scale = output
    ctx.mark_non_differentiable(q, e, p_scale, w_scale)
    _keep_grads(ctx)
    ctx.save_for_backward(q, e, p_scale, w_scale, *weights)
    ctx.x_shape, ctx.x_dtype, ctx.use_triton = x.shape, x.dtype, use_triton
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _swiglu_linear_grads(ctx, dout, *_):
    q, e, p_scale, w_scale, *weights = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dx, need_dw = need[0], any(need[1])
    bias_dtype = ctx.bias_dtype if need[2] else None
    dx, dw, db = _swiglu_linear_backward(dout, q, e, p_scale, w_scale, weights, need_dx, need_dw, bias_dtype,
                                         ctx.x_dtype, ctx.use_triton)
    return (dx.reshape(ctx.x_shape) if need_dx else None, _split(dw, weights) if need_dw else [None] * len(weights),
            db if bias_dtype is not None else None, None, None)


_swiglu_linear.register_autograd(_swiglu_linear_grads, setup_context=_swiglu_linear_setup)


def fp8_swiglu_linear(x, weight, bias=None, config=None):
    """functional.fp8_swiglu_linear on the custom ops."""
    config = config or DEFAULT_CONFIG
    weights = list(as_pieces(weight).tensors)
    check_gemm_dims(x.shape[-1] // 2, sum(w.shape[0] for w in weights), "fp8_swiglu_linear")
    swiglu._check(x)
    return _swiglu_linear(x, weights, bias, config.use_triton(x), config.fprop_fast_accum)[0]


# ----------------------------------------------------------------------------------------- fp8_norm_swiglu_mlp
@torch.library.custom_op("coat::fp8_norm_swiglu_mlp", mutates_args=())
def _norm_mlp(x: Tensor, residual: Optional[Tensor], norm_weight: Tensor, norm_bias: Optional[Tensor],
              w1: list[Tensor], b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], norm: str, eps: float,
              zero_centered: bool, use_triton: bool, fast_accum: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                         Tensor]:
    """-> (out, h (absent without a residual), the norm input as E4M3 1x16 (q, e), mean (absent for RMSNorm), rstd,
    fc1's input scale, fc1's weight scale, gate/up as E4M3 1x16 (qa, ea), fc2's input scale, fc2's weight scale)."""
    env = _env(use_triton, fast_accum)
    h, q, e, mean, rstd, y_scale, y8 = norm_to_fp8(x, residual, norm_weight, norm_bias, norm, eps, zero_centered,
                                                    env)
    w1_8, w1_scale = weight_rows(WeightPieces(w1), None, env)
    out_dtype = output_dtype(x)
    a = fp8_gemm(y8, w1_8, y_scale, w1_scale, out_dtype, b1, fast_accum=fast_accum)
    del y8
    qa, ea, amax_p, _ = swiglu.swiglu_forward(a, use_triton)
    del a
    p_scale = finalize_scale(amax_p, E4M3, use_triton)
    p8, _ = swiglu.swiglu_cast(qa, ea, p_scale, use_triton)
    w2_8, w2_scale = weight_rows(WeightPieces([w2]), None, env)
    out = fp8_gemm(p8, w2_8, p_scale, w2_scale, out_dtype, b2, fast_accum=fast_accum)
    h = h.reshape(x.shape) if residual is not None else _absent(x)
    return (out.reshape(*x.shape[:-1], w2.shape[0]), h, q, e, mean if mean is not None else _absent(x), rstd,
            y_scale, w1_scale, qa, ea, p_scale, w2_scale)


@_norm_mlp.register_fake
def _(x, residual, norm_weight, norm_bias, w1, b1, w2, b2, norm, eps, zero_centered, use_triton, fast_accum):
    out = x.new_empty(*x.shape[:-1], w2.shape[0], dtype=output_dtype(x))
    f2 = sum(w.shape[0] for w in w1)
    qa, ea = _swiglu_saved_fake(x.new_empty(_rows(x), f2))
    return (out, *_norm_outputs_fake(x, residual, norm, False), _scale(x), _scale(x), qa, ea, _scale(x),
            _scale(x))


@torch.library.custom_op("coat::fp8_norm_swiglu_mlp_backward", mutates_args=())
def _norm_mlp_backward(dout: Tensor, dres: Optional[Tensor], q: Tensor, e: Tensor, mean: Optional[Tensor],
                       rstd: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], y_scale: Tensor,
                       w1_scale: Tensor, qa: Tensor, ea: Tensor, p_scale: Tensor, w2_scale: Tensor, w1: list[Tensor],
                       w2: Tensor, zero_centered: bool, need_dx: bool, need_dw1: bool, b1_dtype: Optional[torch.dtype],
                       need_db1: bool, need_dw2: bool, b2_dtype: Optional[torch.dtype], use_triton: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dx [M, H] (+ dres), d norm weight, d norm bias, dW1, d b1, dW2, d b2), each absent when not asked for
    (b1_dtype: fc1's bias dtype, None without one; b2_dtype: fc2's when its gradient is asked for); the same passes
    as fused_mlp's backward (d[gate | up] straight to E5M2 when fc1 has no bias)."""
    dx, dnw, dnb, dw1, db1, dw2, db2 = _absents(dout, 7)
    dyn, *grads = swiglu_mlp_backward(
        dout, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
        lambda: _weight_t(w1, w1_scale, use_triton), lambda: _weight_t([w2], w2_scale, use_triton),
        zero_centered=zero_centered, use_triton=use_triton, tickets=None, dout_amax=None, out_dtype=dout.dtype,
        w1_dtype=w1[0].dtype, w2_dtype=w2.dtype, b1_dtype=b1_dtype, b2_dtype=b2_dtype, need_dx=need_dx,
        need_dw1=need_dw1, need_db1=need_db1, need_dw2=need_dw2)
    dw1, db1, dw2, db2 = (g if g is not None else absent for g, absent in zip(grads, (dw1, db1, dw2, db2)))
    if need_dx:
        dx, dnw, dnb = _norm_grads(q, e, mean, rstd, norm_weight, norm_bias, dyn, dres, zero_centered, use_triton)
    return dx, dnw, dnb, dw1, db1, dw2, db2


@_norm_mlp_backward.register_fake
def _(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale, w1, w2,
      zero_centered, need_dx, need_dw1, b1_dtype, need_db1, need_dw2, b2_dtype, use_triton):
    _, dw1, db1 = _gemm_grads_fake(qa, w1, False, need_dw1, b1_dtype if need_db1 else None)
    _, dw2, db2 = _gemm_grads_fake(dout, [w2], False, need_dw2, b2_dtype)
    return (*_norm_grads_fake(q, norm_weight, norm_bias, dout.dtype, need_dx), dw1, db1, dw2, db2)


def _norm_mlp_setup(ctx, inputs, output):
    x, residual, norm_weight, norm_bias, w1, b1, w2, b2, norm, _, zero_centered, use_triton, _ = inputs
    out, _, q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale = output
    ctx.mark_non_differentiable(q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale)
    _keep_grads(ctx)
    ctx.save_for_backward(q, e, mean if norm == "layernorm" else None, rstd, norm_weight, norm_bias, y_scale,
                          w1_scale, qa, ea, p_scale, w2_scale, w2, *w1)
    ctx.has_residual, ctx.zero_centered, ctx.use_triton = residual is not None, zero_centered, use_triton
    ctx.x_shape, ctx.out_shape, ctx.out_dtype = x.shape, out.shape, out.dtype
    ctx.b1_dtype = b1.dtype if b1 is not None else None
    ctx.b2_dtype = b2.dtype if b2 is not None else None


def _norm_mlp_grads(ctx, dout, dh, *_):
    q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale, w2, *w1 = \
        ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dx, need_dw1, need_dw2 = any(need[:4]), any(need[4]), need[6]
    need_db1 = need[5] and ctx.b1_dtype is not None
    b2_dtype = ctx.b2_dtype if need[7] else None
    dout = _grad_or_zeros(dout, ctx.out_shape, ctx.out_dtype, q)
    dx, dnw, dnb, dw1, db1, dw2, db2 = _norm_mlp_backward(
        dout, dh if ctx.has_residual else None, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea,
        p_scale, w2_scale, w1, w2, ctx.zero_centered, need_dx, need_dw1, ctx.b1_dtype, need_db1, need_dw2, b2_dtype,
        ctx.use_triton)
    if need_dx:
        dx = dx.reshape(ctx.x_shape)
    else:
        dx = dnw = dnb = None
    return (dx, dx if ctx.has_residual else None, dnw, dnb if norm_bias is not None else None,
            _split(dw1, w1) if need_dw1 else [None] * len(w1), db1 if need_db1 else None,
            dw2 if need_dw2 else None, db2 if b2_dtype is not None else None, None, None, None, None, None)


_norm_mlp.register_autograd(_norm_mlp_grads, setup_context=_norm_mlp_setup)


def fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None,
                        residual=None, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False, config=None):
    """fused_mlp.fp8_norm_swiglu_mlp on the custom ops."""
    config = config or DEFAULT_CONFIG
    w1 = list(as_pieces(fc1_weight).tensors)
    f2 = sum(w.shape[0] for w in w1)
    _check_norm(norm, x.shape[-1])
    check_gemm_dims(x.shape[-1], f2, "fp8_norm_swiglu_mlp fc1")
    check_gemm_dims(f2 // 2, fc2_weight.shape[0], "fp8_norm_swiglu_mlp fc2")
    out, h, *_ = _norm_mlp(x, residual, norm_weight, norm_bias, w1, fc1_bias, fc2_weight, fc2_bias, norm, float(eps),
                           zero_centered_gamma, config.use_triton(x), config.fprop_fast_accum)
    return (out, h) if residual is not None else out


# ----------------------------------------------------------------------------- fp8_swiglu, fp8_gelu, fp8_silu
@torch.library.custom_op("coat::fp8_swiglu", mutates_args=())
def _swiglu(x: Tensor, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (silu(gate) * up, x as E4M3 1x16 (codes [M, 2F], scales))."""
    f2 = x.shape[-1]
    q, e, _, y = swiglu.swiglu_forward(x.reshape(-1, f2), use_triton, write_out=True)
    return y.reshape(*x.shape[:-1], f2 // 2), q, e


@_swiglu.register_fake
def _(x, use_triton):
    return (x.new_empty(*x.shape[:-1], x.shape[-1] // 2), *_swiglu_saved_fake(x))


@torch.library.custom_op("coat::fp8_swiglu_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, q: Tensor, e: Tensor, x_dtype: torch.dtype, use_triton: bool) -> Tensor:
    return swiglu.swiglu_backward(q, e, dy.reshape(q.shape[0], -1), use_triton)[0].to(x_dtype)


@_swiglu_backward.register_fake
def _(dy, q, e, x_dtype, use_triton):
    return q.new_empty(q.shape, dtype=x_dtype)


def _swiglu_setup(ctx, inputs, output):
    x, use_triton = inputs
    _, q, e = output
    ctx.mark_non_differentiable(q, e)
    _keep_grads(ctx)
    ctx.save_for_backward(q, e)
    ctx.x_shape, ctx.x_dtype, ctx.use_triton = x.shape, x.dtype, use_triton


def _swiglu_grads(ctx, dy, *_):
    q, e = ctx.saved_tensors
    return _swiglu_backward(dy, q, e, ctx.x_dtype, ctx.use_triton).reshape(ctx.x_shape), None


_swiglu.register_autograd(_swiglu_grads, setup_context=_swiglu_setup)


def fp8_swiglu(x, config=None):
    """functional.fp8_swiglu on the custom ops."""
    swiglu._check(x)
    return _swiglu(x, (config or DEFAULT_CONFIG).use_triton(x))[0]


@torch.library.custom_op("coat::fp8_act", mutates_args=())
def _act(x: Tensor, name: str, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (act(x), x as E4M3 1x16 (codes shaped like x, scales [..., K/16]))."""
    return pointwise.act_forward(x, name, use_triton)


@_act.register_fake
def _(x, name, use_triton):
    return x.new_empty(x.shape), _fp8(x, *x.shape), x.new_empty(*x.shape[:-1], x.shape[-1] // GROUP,
                                                                  dtype=SCALE_DTYPE)


@torch.library.custom_op("coat::fp8_act_backward", mutates_args=())
def _act_backward(dy: Tensor, q: Tensor, e: Tensor, name: str, use_triton: bool) -> Tensor:
    return pointwise.act_backward(q, e, dy, name, use_triton)


@_act_backward.register_fake
def _(dy, q, e, name, use_triton):
    return dy.new_empty(q.shape)


def _act_setup(ctx, inputs, output):
    _, name, use_triton = inputs
    _, q, e = output
    ctx.mark_non_differentiable(q, e)
    _keep_grads(ctx)
    ctx.save_for_backward(q, e)
    ctx.name, ctx.use_triton = name, use_triton


def _act_grads(ctx, dy, *_):
    q, e = ctx.saved_tensors
    return _act_backward(dy, q, e, ctx.name, ctx.use_triton), None, None


_act.register_autograd(_act_grads, setup_context=_act_setup)


def fp8_act(x, name, config=None):
    """functional.fp8_gelu ("gelu") and fp8_silu ("silu") on the custom ops."""
    pointwise._act_id(name)
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim must be a multiple of {GROUP} (1x16 groups), got {x.shape[-1]}")
    return _act(x, name, (config or DEFAULT_CONFIG).use_triton(x))[0]


# -------------------------------------------------------------------------------------------------- rope_split
@torch.library.custom_op("coat::rope_split", mutates_args=())
def _rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_heads: int, kv_heads: int, head_dim: int, layout: str,
          rows_per_position: int, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (q, k, v): new contiguous tensors, q and k rotated (rope.rope_split's forward)."""
    lay = QKVLayout(layout, q_heads, kv_heads, head_dim)
    if not use_triton:
        q, k, v = lay.split_reference(qkv)
        return (rope_reference(q, cos, sin, head_dim, 1.0, rows_per_position),
                rope_reference(k, cos, sin, head_dim, 1.0, rows_per_position), v.clone())
    t = qkv.shape[0]
    qkv = qkv.contiguous()
    outs = [torch.empty(t, h * head_dim, dtype=qkv.dtype, device=qkv.device) for h in (q_heads, kv_heads, kv_heads)]
    if t:
        rope_launch(qkv, True, outs, lay, cos, sin, t, rows_per_position, 1.0, dict(_NO_PARTIALS))
    return tuple(outs)


_NO_PARTIALS = dict(partials=None, ticket_ptr=None, scale_ptr=None, NP=1, FP8_MAX=1.0, FINAL=False)


@_rope.register_fake
def _(qkv, cos, sin, q_heads, kv_heads, head_dim, layout, rows_per_position, use_triton):
    t = qkv.shape[0]
    return tuple(qkv.new_empty(t, h * head_dim) for h in (q_heads, kv_heads, kv_heads))


@torch.library.custom_op("coat::rope_split_backward", mutates_args=())
def _rope_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, q_heads: int, kv_heads: int,
                   head_dim: int, layout: str, rows_per_position: int, use_triton: bool) -> Tensor:
    """d(qkv) [T, width] in qkv's layout: the inverse rotation of dq and dk, dv copied (no amax partials: nothing
    takes them in the compiled path)."""
    lay = QKVLayout(layout, q_heads, kv_heads, head_dim)
    if not use_triton:
        return lay.join_reference(rope_reference(dq, cos, sin, head_dim, -1.0, rows_per_position),
                                  rope_reference(dk, cos, sin, head_dim, -1.0, rows_per_position), dv)
    t = dq.shape[0]
    dqkv = torch.empty(t, lay.width, dtype=dq.dtype, device=dq.device)
    if t:
        rope_launch(dqkv, False, [g.contiguous() for g in (dq, dk, dv)], lay, cos, sin, t, rows_per_position, -1.0,
                    dict(_NO_PARTIALS))
    return dqkv


@_rope_backward.register_fake
def _(dq, dk, dv, cos, sin, q_heads, kv_heads, head_dim, layout, rows_per_position, use_triton):
    return dq.new_empty(dq.shape[0], (q_heads + 2 * kv_heads) * head_dim)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, *meta = inputs
    ctx.save_for_backward(cos, sin)
    ctx.meta = meta


def _rope_grads(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    return (_rope_backward(dq, dk, dv, cos, sin, *ctx.meta),) + (None,) * 8


_rope.register_autograd(_rope_grads, setup_context=_rope_setup)


def rope_split(qkv, cos, sin, head_dim, kv_heads, use_triton, layout="split", rows_per_position=1):
    """rope.rope_split on the custom ops (its arguments already checked)."""
    q_heads = qkv.shape[-1] // head_dim - 2 * kv_heads
    return _rope(qkv, cos, sin, q_heads, kv_heads, head_dim, layout, rows_per_position, use_triton)
