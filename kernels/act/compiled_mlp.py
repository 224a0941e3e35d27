"""`fused_mlp.fp8_norm_swiglu_mlp` as torch.library custom ops (the path torch.compile takes; see `compiled_ops`
for what the ops take and leave out): one forward op, one backward op over `block_bodies.norm_mlp_forward` and
`norm_mlp_backward`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import block_bodies as body
from .block_parts import DEFAULT_CONFIG, WeightOperand, output_dtype, plain_env
from .compiled_parts import (check_norm, gemm_grads_fake, grad_or_zeros, keep_grads, norm_grads_fake,
                             norm_outputs_fake, or_absent, rows_of, scale_like, split_rows, swiglu_saved_fake)
from .gemm import check_gemm_dims
from .weights import WeightPieces, as_pieces


@torch.library.custom_op("coat::fp8_norm_swiglu_mlp", mutates_args=())
def _norm_mlp(x: Tensor, residual: Optional[Tensor], norm_weight: Tensor, norm_bias: Optional[Tensor],
              w1: list[Tensor], b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], norm: str, eps: float,
              zero_centered: bool, activation: str, use_triton: bool, fast_accum: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                         Tensor]:
    """-> (out, h (absent without a residual), the norm input as E4M3 1x16 (q, e), mean (absent for RMSNorm), rstd,
    fc1's input scale, fc1's weight scale, gate/up as E4M3 1x16 (qa, ea), fc2's input scale, fc2's weight scale)."""
    out, h, q, e, mean, rstd, *scales_and_saved = body.norm_mlp_forward(
        x, residual, norm_weight, norm_bias, WeightPieces(w1), b1, WeightPieces([w2]), b2, None, None, norm, eps,
        zero_centered, activation, plain_env(use_triton, fast_accum))
    return (out, or_absent(h, x), q, e, or_absent(mean, x), rstd, *scales_and_saved)


@_norm_mlp.register_fake
def _(x, residual, norm_weight, norm_bias, w1, b1, w2, b2, norm, eps, zero_centered, activation, use_triton,
      fast_accum):
    out = x.new_empty(*x.shape[:-1], w2.shape[0], dtype=output_dtype(x))
    f2 = sum(w.shape[0] for w in w1)
    qa, ea = swiglu_saved_fake(x.new_empty(rows_of(x), f2))
    return (out, *norm_outputs_fake(x, residual, norm, False), scale_like(x), scale_like(x), qa, ea, scale_like(x),
            scale_like(x))


@torch.library.custom_op("coat::fp8_norm_swiglu_mlp_backward", mutates_args=())
def _norm_mlp_backward(dout: Tensor, dres: Optional[Tensor], q: Tensor, e: Tensor, mean: Optional[Tensor],
                       rstd: Tensor, norm_weight: Tensor, norm_bias: Optional[Tensor], y_scale: Tensor,
                       w1_scale: Tensor, qa: Tensor, ea: Tensor, p_scale: Tensor, w2_scale: Tensor, w1: list[Tensor],
                       w2: Tensor, zero_centered: bool, need_dx: bool, need_dw1: bool, b1_dtype: Optional[torch.dtype],
                       need_db1: bool, need_dw2: bool, b2_dtype: Optional[torch.dtype], activation: str,
                       use_triton: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dx [M, H] (+ dres), d norm weight, d norm bias, dW1, d b1, dW2, d b2), each absent when not asked for
    (b1_dtype: fc1's bias dtype, None without one; b2_dtype: fc2's when its gradient is asked for)."""
    dx, dnw, dnb, _, *weight_grads = body.norm_mlp_backward(
        dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
        WeightOperand.of(w1), WeightOperand.of([w2]), zero_centered, dout.dtype, b1_dtype, b2_dtype, need_dx,
        need_dw1, need_db1, need_dw2, activation, plain_env(use_triton))
    return tuple(or_absent(g, dout) for g in (dx, dnw, dnb, *weight_grads))


@_norm_mlp_backward.register_fake
def _(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale, w1, w2,
      zero_centered, need_dx, need_dw1, b1_dtype, need_db1, need_dw2, b2_dtype, activation, use_triton):
    _, dw1, db1 = gemm_grads_fake(qa, w1, False, need_dw1, b1_dtype if need_db1 else None)
    _, dw2, db2 = gemm_grads_fake(dout, [w2], False, need_dw2, b2_dtype)
    return (*norm_grads_fake(q, norm_weight, norm_bias, dout.dtype, need_dx), dw1, db1, dw2, db2)

def _norm_mlp_setup(ctx, inputs, output):
    x, residual, norm_weight, norm_bias, w1, b1, w2, b2, norm, _, zero_centered, activation, use_triton, _ = inputs
    out, _, q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale = output
    ctx.mark_non_differentiable(q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale)
    keep_grads(ctx)
    ctx.save_for_backward(q, e, mean if norm == "layernorm" else None, rstd, norm_weight, norm_bias, y_scale,
                          w1_scale, qa, ea, p_scale, w2_scale, w2, *w1)
    ctx.has_residual, ctx.zero_centered, ctx.use_triton = residual is not None, zero_centered, use_triton
    ctx.activation = activation
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
    dout = grad_or_zeros(dout, ctx.out_shape, ctx.out_dtype, q)
    dx, dnw, dnb, dw1, db1, dw2, db2 = _norm_mlp_backward(
        dout, dh if ctx.has_residual else None, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea,
        p_scale, w2_scale, w1, w2, ctx.zero_centered, need_dx, need_dw1, ctx.b1_dtype, need_db1, need_dw2, b2_dtype,
        ctx.activation, ctx.use_triton)
    if need_dx:
        dx = dx.reshape(ctx.x_shape)
    else:
        dx = dnw = dnb = None
    return (dx, dx if ctx.has_residual else None, dnw, dnb if norm_bias is not None else None,
            split_rows(dw1, w1) if need_dw1 else [None] * len(w1), db1 if need_db1 else None,
            dw2 if need_dw2 else None, db2 if b2_dtype is not None else None, None, None, None, None, None, None)


_norm_mlp.register_autograd(_norm_mlp_grads, setup_context=_norm_mlp_setup)


def fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None,
                        residual=None, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False, activation="silu",
                        config=None):
    """fused_mlp.fp8_norm_swiglu_mlp on the custom ops."""
    config = config or DEFAULT_CONFIG
    w1 = list(as_pieces(fc1_weight).tensors)
    f2 = sum(w.shape[0] for w in w1)
    check_norm(norm, x.shape[-1])
    check_gemm_dims(x.shape[-1], f2, "fp8_norm_swiglu_mlp fc1")
    check_gemm_dims(f2 // 2, fc2_weight.shape[0], "fp8_norm_swiglu_mlp fc2")
    out, h, *_ = _norm_mlp(x, residual, norm_weight, norm_bias, w1, fc1_bias, fc2_weight, fc2_bias, norm, float(eps),
                           zero_centered_gamma, activation, config.use_triton(x), config.fprop_fast_accum)
    return (out, h) if residual is not None else out
