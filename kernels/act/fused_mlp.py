"""norm -> fc1 -> SwiGLU -> fc2 as one autograd node (TransformerEngine's LayerNormMLP with SwiGLU, on COAT's FP8
flow), so that backward can take d[gate | up] straight to E5M2: a pass that computes its partial amaxes (and, from
the same loads, the product's transposed E4M3 copy for fc2's weight gradient), then `swiglu_backward_cast`
recomputing it into the row-major and transposed E5M2 operands of fc1's dgrad and wgrad. The BF16 gradient is never
written: 2 bytes per element less written and read than fp8_(add_)norm_linear followed by fp8_swiglu_linear, with
exactly their numerics and saved tensors.
"""
from __future__ import annotations

import torch

from ..formats import E4M3
from . import compiled_ops
from . import swiglu
from .config import ActivationConfig
from .block_parts import (block_env, gradient_amax, keep_two_weights, norm_input_grad, norm_to_fp8, output_dtype,
                          swiglu_mlp_backward, usable_cache, weight_rows, weight_transposed)
from .gemm import check_gemm_dims, fp8_gemm
from .runtime import CoatRuntime
from .scaling import finalize_scale
from .weights import WeightCache, WeightPieces, as_pieces


class _Fp8NormMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, b1, w2, b2, cache1, cache2, kind, eps, zero_centered, env,
                *w1):
        fc1, fc2 = WeightPieces(w1), WeightPieces([w2])
        hdim, f2, n = x.shape[-1], fc1.shape[0], w2.shape[0]
        check_gemm_dims(hdim, f2, "fp8_norm_swiglu_mlp fc1")
        check_gemm_dims(f2 // 2, n, "fp8_norm_swiglu_mlp fc2")
        h, q, e, mean, rstd, y_scale, y8 = norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps,
                                                        zero_centered, env)
        w1_8, w1_scale = weight_rows(fc1, cache1, env)
        out_dtype = output_dtype(x)
        a = fp8_gemm(y8, w1_8, y_scale, w1_scale, out_dtype, b1, fast_accum=env.fast_accum)
        del y8
        qa, ea, amax_p, _ = swiglu.swiglu_forward(a, env.use_triton, tickets=env.tickets)
        del a
        p_scale = finalize_scale(amax_p, E4M3, env.use_triton)
        p8, _ = swiglu.swiglu_cast(qa, ea, p_scale, env.use_triton)
        w2_8, w2_scale = weight_rows(fc2, cache2, env)
        out = fp8_gemm(p8, w2_8, p_scale, w2_scale, out_dtype, b2, fast_accum=env.fast_accum)
        out = out.reshape(*x.shape[:-1], n)
        ctx.cache1, ctx.cache2, ctx.out_dtype, ctx.zero_centered, ctx.env = cache1, cache2, out_dtype, \
            zero_centered, env
        ctx.has_residual, ctx.shape = residual is not None, x.shape
        ctx.b1_dtype = b1.dtype if b1 is not None else None
        ctx.b2_dtype = b2.dtype if b2 is not None else None
        kept, ctx.n_fc1_saved = keep_two_weights(ctx, fc1, cache1, fc2, cache2, env)
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
                              *kept)
        if residual is None:
            return out
        return out, h.reshape(x.shape)

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale, *kept = \
            ctx.saved_tensors
        fc1_like, fc2_like = ctx.weight_likes
        fc1 = WeightPieces(kept[:ctx.n_fc1_saved]) if ctx.n_fc1_saved else None
        fc2 = WeightPieces(kept[ctx.n_fc1_saved:]) if len(kept) > ctx.n_fc1_saved else None
        env, tri = ctx.env, ctx.env.use_triton
        need = ctx.needs_input_grad
        need_dx = any(need[:4])
        need_dw1 = any(need[13:])
        dyn, dw1, db1, dw2, db2 = swiglu_mlp_backward(
            dout, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
            lambda: weight_transposed(ctx.cache1, fc1_like, fc1, w1_scale, tri),
            lambda: weight_transposed(ctx.cache2, fc2_like, fc2, w2_scale, tri),
            zero_centered=ctx.zero_centered, use_triton=tri, tickets=env.tickets, dout_amax=gradient_amax(env, dout),
            out_dtype=ctx.out_dtype, w1_dtype=fc1_like.dtype, w2_dtype=fc2_like.dtype, b1_dtype=ctx.b1_dtype,
            b2_dtype=ctx.b2_dtype if need[6] else None, need_dx=need_dx, need_dw1=need_dw1, need_db1=need[4],
            need_dw2=need[5])
        dw1 = fc1_like.split(dw1) if dw1 is not None else (None,) * len(fc1_like.rows)
        dx = dres = dnw = dnb = None
        if dyn is not None:
            dres_in = dh.reshape(q.shape) if (ctx.has_residual and dh is not None) else None
            dx, dnw, dnb = norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dyn, dres_in)
            dres = dx if ctx.has_residual else None
        return (dx, dres, dnw, dnb, db1, dw2, db2) + (None,) * 6 + dw1


def fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None, *,
                        residual=None, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False,
                        config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
                        fc1_cache: WeightCache | None = None, fc2_cache: WeightCache | None = None):
    """fc2(silu(gate) * up), [gate | up] = fc1(norm(h)), h = x (+ residual). Returns y, or (y, h) with a residual
    (h as in fp8_add_norm_linear). fc1_weight may be row blocks, e.g. (gate_proj.weight, up_proj.weight)."""
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias, fc2_bias,
                                                residual, norm, eps, zero_centered_gamma, config)
    return _Fp8NormMLP.apply(x, residual, norm_weight, norm_bias, fc1_bias, fc2_weight, fc2_bias,
                             usable_cache(fc1_cache, config, runtime), usable_cache(fc2_cache, config, runtime), norm,
                             eps, zero_centered_gamma, block_env(x, config, runtime), *as_pieces(fc1_weight).tensors)
