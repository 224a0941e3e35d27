"""The FP8 blocks as `torch.library` custom ops: the path `torch.compile` takes.

Under `torch.compiler.is_compiling()` each public block of `functional` and `rope` calls the function of the same
name here (`fused_mlp`: `compiled_mlp`) instead of its autograd Function. Both are shells over the same bodies
(`block_bodies`, `rope_kernel`): here each body runs inside an op, its absent outputs made empty tensors. Dynamo and
AOTAutograd see one opaque op per block forward
(namespace "coat") and one per block backward, each with a fake implementation (exact output shapes, dtypes and
strides, the FP8 tensors saved for backward included), tied together by `torch.library.register_autograd`; they
never trace into autograd Functions, Triton launchers or the runtime's Python state.

The ops take tensors and plain values only, so nothing of a `CoatRuntime` crosses into them:
- no weight cache: the forward op quantizes its weights, the backward op re-casts the transposed copy from the
  weight with the forward's scale (eager's path with cache_weights=False);
- no gradient-amax hand-off: each backward quantizes its output gradient with an amax pass of its own;
- no shared scale tickets: kernels that finish their own scale get a fresh zeroed word pair (scaling.stage_two_args).
The values are those of the eager blocks: a cached weight is the same quantization, and a handed-off amax is the
amax of the same tensor, so a compiled model computes the eager model's bits wherever the same kernels run. The
norm + SwiGLU MLP's ops are in `compiled_mlp`.

An output a block does not produce (the residual stream without a residual, LayerNorm's mean for RMSNorm, the input
copy of fp8_linear with reuse_input, a gradient nobody needs) is an empty uint8 tensor (custom ops return tensors
only; an integer tensor is never differentiable).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import block_bodies as body
from . import pointwise, swiglu
from .block_parts import DEFAULT_CONFIG, WeightOperand, output_dtype, plain_env
from .compiled_parts import (absent, check_norm, fp8_like, gemm_grads_fake, grad_or_zeros, keep_grads,
                             norm_grads_fake, norm_outputs_fake, or_absent, rows_of, scale_like, split_rows,
                             swiglu_saved_fake)
from .gemm import check_gemm_dims
from .group_quant import SCALE_DTYPE
from .rope_kernel import QKVLayout, rope_backward, rope_forward
from .tiles import GROUP, pad16
from .weights import WeightPieces, as_pieces


# ------------------------------------------------------------------------------------------------- fp8_linear
@torch.library.custom_op("coat::fp8_linear", mutates_args=())
def _linear(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], reuse_input: bool, use_triton: bool,
            fast_accum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (y, x^T as E4M3 [K, pad16(M)] (absent with reuse_input), x's scale, the weight's scale)."""
    y, x8_t, x_scale, w_scale = body.linear_forward(x, WeightPieces(weights), bias, None, reuse_input,
                                                    plain_env(use_triton, fast_accum))
    return y, or_absent(x8_t, x), x_scale, w_scale


@_linear.register_fake
def _(x, weights, bias, reuse_input, use_triton, fast_accum):
    k, n = x.shape[-1], sum(w.shape[0] for w in weights)
    x8_t = absent(x) if reuse_input else fp8_like(x, k, pad16(rows_of(x)))
    return x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x)), x8_t, scale_like(x), scale_like(x)


@torch.library.custom_op("coat::fp8_linear_backward", mutates_args=())
def _linear_backward(dy: Tensor, saved_x: Tensor, x_scale: Tensor, w_scale: Tensor, weights: list[Tensor],
                     reuse_input: bool, need_dx: bool, need_dw: bool, bias_dtype: Optional[torch.dtype],
                     use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx [M, K], dW [N, K], d bias), each absent when not asked for."""
    grads = body.linear_backward(dy, saved_x, x_scale, w_scale, WeightOperand.of(weights), reuse_input, dy.dtype,
                                 need_dx, need_dw, bias_dtype, plain_env(use_triton))
    return tuple(or_absent(g, dy) for g in grads)


@_linear_backward.register_fake
def _(dy, saved_x, x_scale, w_scale, weights, reuse_input, need_dx, need_dw, bias_dtype, use_triton):
    return gemm_grads_fake(dy, weights, need_dx, need_dw, bias_dtype)


def _linear_setup(ctx, inputs, output):
    x, weights, bias, reuse_input, use_triton, _ = inputs
    _, x8_t, x_scale, w_scale = output
    ctx.mark_non_differentiable(x8_t, x_scale, w_scale)
    keep_grads(ctx)
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
    return (dx.reshape(ctx.x_shape) if need_dx else None, split_rows(dw, weights) if need_dw else [None] * len(weights),
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
    out, h, q, e, mean, rstd, y_scale, w_scale = body.norm_linear_forward(
        x, residual, norm_weight, norm_bias, WeightPieces(weights), bias, None, norm, eps, zero_centered,
        plain_env(use_triton, fast_accum))
    if h is None:
        h = x.clone(memory_format=torch.contiguous_format) if residual_out else absent(x)
    return out, h, q, e, or_absent(mean, x), rstd, y_scale, w_scale


@_norm_linear.register_fake
def _(x, residual, norm_weight, norm_bias, weights, bias, norm, eps, zero_centered, residual_out, use_triton,
      fast_accum):
    n = sum(w.shape[0] for w in weights)
    out = x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x))
    return (out, *norm_outputs_fake(x, residual, norm, residual_out), scale_like(x), scale_like(x))


@torch.library.custom_op("coat::fp8_norm_linear_backward", mutates_args=())
def _norm_linear_backward(dout: Tensor, dres: Optional[Tensor], q: Tensor, e: Tensor, mean: Optional[Tensor],
                          rstd: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], y_scale: Tensor,
                          w_scale: Tensor, weights: list[Tensor], zero_centered: bool, need_dx: bool, need_dw: bool,
                          bias_dtype: Optional[torch.dtype], use_triton: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dx [M, H] (+ dres), d norm weight, d norm bias, dW, d bias); dx and the norm's gradients come together
    (need_dx), each absent when not asked for."""
    dx, dnw, dnb, _, dw, db = body.norm_linear_backward(
        dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, WeightOperand.of(weights),
        zero_centered, dout.dtype, need_dx, need_dw, bias_dtype, plain_env(use_triton))
    return tuple(or_absent(g, dout) for g in (dx, dnw, dnb, dw, db))


@_norm_linear_backward.register_fake
def _(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, weights, zero_centered, need_dx,
      need_dw, bias_dtype, use_triton):
    _, dw, db = gemm_grads_fake(dout, weights, False, need_dw, bias_dtype)
    return (*norm_grads_fake(q, norm_weight, norm_bias, dout.dtype, need_dx), dw, db)


def _norm_linear_setup(ctx, inputs, output):
    x, residual, norm_weight, norm_bias, weights, bias, norm, _, zero_centered, _, use_triton, _ = inputs
    out, _, q, e, mean, rstd, y_scale, w_scale = output
    ctx.mark_non_differentiable(q, e, mean, rstd, y_scale, w_scale)
    keep_grads(ctx)
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
    dout = grad_or_zeros(dout, ctx.out_shape, ctx.out_dtype, q)
    dx, dnw, dnb, dw, db = _norm_linear_backward(dout, dh, q, e, mean, rstd, norm_weight, norm_bias, y_scale,
                                                 w_scale, weights, ctx.zero_centered, need_dx, need_dw, bias_dtype,
                                                 ctx.use_triton)
    if need_dx:
        dx = dx.reshape(ctx.x_shape)
    else:
        dx = dnw = dnb = None
    return (dx, dx if ctx.has_residual else None, dnw, dnb if norm_bias is not None else None,
            split_rows(dw, weights) if need_dw else [None] * len(weights), db if bias_dtype is not None else None,
            None, None, None, None, None, None)


_norm_linear.register_autograd(_norm_linear_grads, setup_context=_norm_linear_setup)


def fp8_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, residual_out=False, config=None):
    """functional.fp8_norm_linear (residual None) and fp8_add_norm_linear on the custom ops."""
    config = config or DEFAULT_CONFIG
    weights = list(as_pieces(weight).tensors)
    check_norm(norm, x.shape[-1])
    check_gemm_dims(x.shape[-1], sum(w.shape[0] for w in weights), "fp8_norm_linear")
    out, h, *_ = _norm_linear(x, residual, norm_weight, norm_bias, weights, bias, norm, float(eps),
                              zero_centered_gamma, residual_out, config.use_triton(x), config.fprop_fast_accum)
    return (out, h) if residual is not None or residual_out else out


# -------------------------------------------------------------------------------------------- fp8_swiglu_linear
@torch.library.custom_op("coat::fp8_swiglu_linear", mutates_args=())
def _swiglu_linear(x: Tensor, weights: list[Tensor], bias: Optional[Tensor], activation: str, use_triton: bool,
                   fast_accum: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (out, gate/up as E4M3 1x16 (codes, scales), the product's scale, the weight's scale)."""
    return body.swiglu_linear_forward(x, WeightPieces(weights), bias, None, activation,
                                      plain_env(use_triton, fast_accum))


@_swiglu_linear.register_fake
def _(x, weights, bias, activation, use_triton, fast_accum):
    n = sum(w.shape[0] for w in weights)
    return (x.new_empty(*x.shape[:-1], n, dtype=output_dtype(x)), *swiglu_saved_fake(x), scale_like(x), scale_like(x))


@torch.library.custom_op("coat::fp8_swiglu_linear_backward", mutates_args=())
def _swiglu_linear_backward(dout: Tensor, q: Tensor, e: Tensor, p_scale: Tensor, w_scale: Tensor,
                            weights: list[Tensor], need_dx: bool, need_dw: bool, bias_dtype: Optional[torch.dtype],
                            x_dtype: torch.dtype, activation: str, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (d[gate | up] [M, 2F] in x's dtype, dW, d bias), each absent when not asked for."""
    dx, _, dw, db = body.swiglu_linear_backward(dout, q, e, p_scale, w_scale, WeightOperand.of(weights), dout.dtype,
                                                x_dtype, need_dx, need_dw, bias_dtype, activation,
                                                plain_env(use_triton))
    return tuple(or_absent(g, dout) for g in (dx, dw, db))


@_swiglu_linear_backward.register_fake
def _(dout, q, e, p_scale, w_scale, weights, need_dx, need_dw, bias_dtype, x_dtype, activation, use_triton):
    _, dw, db = gemm_grads_fake(dout, weights, False, need_dw, bias_dtype)
    return (q.new_empty(q.shape, dtype=x_dtype) if need_dx else absent(dout)), dw, db


def _swiglu_linear_setup(ctx, inputs, output):
    x, weights, bias, activation, use_triton, _ = inputs
    _, q, e, p_scale, w_scale = output
    ctx.mark_non_differentiable(q, e, p_scale, w_scale)
    keep_grads(ctx)
    ctx.save_for_backward(q, e, p_scale, w_scale, *weights)
    ctx.x_shape, ctx.x_dtype, ctx.use_triton, ctx.activation = x.shape, x.dtype, use_triton, activation
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _swiglu_linear_grads(ctx, dout, *_):
    q, e, p_scale, w_scale, *weights = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dx, need_dw = need[0], any(need[1])
    bias_dtype = ctx.bias_dtype if need[2] else None
    dx, dw, db = _swiglu_linear_backward(dout, q, e, p_scale, w_scale, weights, need_dx, need_dw, bias_dtype,
                                         ctx.x_dtype, ctx.activation, ctx.use_triton)
    return (dx.reshape(ctx.x_shape) if need_dx else None, split_rows(dw, weights) if need_dw else [None] * len(weights),
            db if bias_dtype is not None else None, None, None, None)


_swiglu_linear.register_autograd(_swiglu_linear_grads, setup_context=_swiglu_linear_setup)


def fp8_swiglu_linear(x, weight, bias=None, activation="silu", config=None):
    """functional.fp8_swiglu_linear on the custom ops."""
    config = config or DEFAULT_CONFIG
    weights = list(as_pieces(weight).tensors)
    check_gemm_dims(x.shape[-1] // 2, sum(w.shape[0] for w in weights), "fp8_swiglu_linear")
    swiglu._check(x)
    return _swiglu_linear(x, weights, bias, activation, config.use_triton(x), config.fprop_fast_accum)[0]


# ---------------------------------------------------------------------------------------------------- fp8_gelu
@torch.library.custom_op("coat::fp8_act", mutates_args=())
def _act(x: Tensor, name: str, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (act(x), x as E4M3 1x16 (codes shaped like x, scales [..., K/16]))."""
    return pointwise.act_forward(x, name, use_triton)


@_act.register_fake
def _(x, name, use_triton):
    return x.new_empty(x.shape), fp8_like(x, *x.shape), x.new_empty(*x.shape[:-1], x.shape[-1] // GROUP,
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
    keep_grads(ctx)
    ctx.save_for_backward(q, e)
    ctx.name, ctx.use_triton = name, use_triton


def _act_grads(ctx, dy, *_):
    q, e = ctx.saved_tensors
    return _act_backward(dy, q, e, ctx.name, ctx.use_triton), None, None


_act.register_autograd(_act_grads, setup_context=_act_setup)


def fp8_act(x, name, config=None):
    """functional.fp8_gelu ("gelu") on the custom ops."""
    pointwise._act_id(name)
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim must be a multiple of {GROUP} (1x16 groups), got {x.shape[-1]}")
    return _act(x, name, (config or DEFAULT_CONFIG).use_triton(x))[0]


# -------------------------------------------------------------------------------------------------- rope_split
@torch.library.custom_op("coat::rope_split", mutates_args=())
def _rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_heads: int, kv_heads: int, head_dim: int, layout: str,
          rows_per_position: int, use_triton: bool) -> tuple[Tensor, Tensor, Tensor]:
    """-> (q, k, v): new contiguous tensors, q and k rotated (rope.rope_split's forward)."""
    return rope_forward(qkv, cos, sin, QKVLayout(layout, q_heads, kv_heads, head_dim), rows_per_position,
                        use_triton)


@_rope.register_fake
def _(qkv, cos, sin, q_heads, kv_heads, head_dim, layout, rows_per_position, use_triton):
    t = qkv.shape[0]
    return tuple(qkv.new_empty(t, h * head_dim) for h in (q_heads, kv_heads, kv_heads))


@torch.library.custom_op("coat::rope_split_backward", mutates_args=())
def _rope_backward(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, q_heads: int, kv_heads: int,
                   head_dim: int, layout: str, rows_per_position: int, use_triton: bool) -> Tensor:
    """d(qkv) [T, width] in qkv's layout: the inverse rotation of dq and dk, dv copied (no amax partials: nothing
    takes them in the compiled path)."""
    return rope_backward(dq, dk, dv, cos, sin, QKVLayout(layout, q_heads, kv_heads, head_dim), rows_per_position,
                         use_triton, False)[0]
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
