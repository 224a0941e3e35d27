"""Each FP8 block's forward and backward, written once: plain functions of tensors and a `BlockEnv`.

The eager autograd Functions (`functional`, `fused_mlp`, `rope`) and the torch.library custom ops of the compiled
path (`compiled_ops`) are shells over these: they save what a forward returns for backward, pass the gradients
asked for, and hand a gradient's amax to the next block (eager only). Which kernel follows which, with which scale
and dtype, is decided here and nowhere else.

Conventions: inputs [..., K] are seen as [M, K]; a forward returns its output shaped like its input and the tensors
its backward needs (FP8 codes, 1x16 scales, row statistics, per-tensor scales); a backward returns gradients as
[M, K] (the shells reshape them), a whole weight's gradient [N, K] (the shells split row blocks), and None for
whatever was not asked for. `weight` arguments of a backward are WeightOperands (the transposed E4M3 copy on demand).
"""
from __future__ import annotations

from ..formats import E4M3, E5M2
from . import norm as norm_ops
from . import swiglu
from .block_parts import BlockEnv, WeightOperand, output_dtype, weight_rows
from .gemm import check_gemm_dims, fp8_gemm
from .scaling import finalize_scale
from .tensor_quant import cast, quantize_tensor
from .weights import WeightPieces


def gemm_backward(dy, weight: WeightOperand, w_scale, input_t, in_scale, out_dtype, need_dx, need_dw, bias_dtype,
                  env: BlockEnv):
    """Backward of y = in @ W^T (+ b) from dy [..., N]: (dgrad [M, K] | None, wgrad [N, K] | None, bias gradient |
    None). dy goes to per-tensor E5M2 (its amax from the hand-off when the producing kernel gave one); input_t(): the
    GEMM input transposed as E4M3 (made only for the wgrad); bias_dtype: None unless the bias gradient is asked for."""
    dy2 = dy.reshape(-1, weight.like.shape[0])
    amax = env.handoff.take(dy) if env.handoff is not None else None
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, env.use_triton, write_row=need_dx, write_t=need_dw, amax=amax,
                                           tickets=env.tickets)
    dx = dw = db = None
    if need_dx:
        dx = fp8_gemm(dy8, weight.transposed(w_scale, env.use_triton), dy_scale, w_scale, out_dtype)
    if need_dw:
        dw = fp8_gemm(dy8_t, input_t(), dy_scale, in_scale, weight.like.dtype)
    if bias_dtype is not None:
        db = dy2.float().sum(0).to(bias_dtype)
    return dx, dw, db


# ------------------------------------------------------------------------------------------------------- linear
def linear_forward(x, weight: WeightPieces, bias, cache, reuse_input, env: BlockEnv):
    """y = x @ W^T + b -> (y, x^T as E4M3 [K, pad16(M)] (None with reuse_input: backward re-casts x itself), x's
    scale, W's scale)."""
    k, n = x.shape[-1], weight.shape[0]
    check_gemm_dims(k, n, "fp8_linear")
    x8, x8_t, x_scale = quantize_tensor(x.reshape(-1, k), E4M3, env.use_triton, write_t=not reuse_input,
                                        tickets=env.tickets)
    w8, w_scale = weight_rows(weight, cache, env)
    y = fp8_gemm(x8, w8, x_scale, w_scale, output_dtype(x), bias, fast_accum=env.fast_accum)
    return y.reshape(*x.shape[:-1], n), x8_t, x_scale, w_scale


def linear_backward(dy, saved_x, x_scale, w_scale, weight: WeightOperand, reuse_input, out_dtype, need_dx, need_dw,
                    bias_dtype, env: BlockEnv):
    """-> (dx [M, K], dW [N, K], d bias); saved_x: x^T as E4M3, or x itself with reuse_input."""
    k = weight.like.shape[1]

    def input_t():
        if reuse_input:
            return cast(saved_x.reshape(-1, k), x_scale, E4M3, env.use_triton, write_row=False, write_t=True)[1]
        return saved_x

    return gemm_backward(dy, weight, w_scale, input_t, x_scale, out_dtype, need_dx, need_dw, bias_dtype, env)


# ------------------------------------------------------------------------------------ norm (+ residual add), linear
def norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered, env: BlockEnv):
    """Forward norm (+ residual add) of x [..., H]: (the sum h [M, H] (None without a residual), its 1x16 FP8 copy
    (q, e), row statistics (mean: None for RMSNorm), the per-tensor E4M3 input of the next GEMM (scale, codes))."""
    hdim = x.shape[-1]
    r2 = residual.reshape(-1, hdim) if residual is not None else None
    h, q, e, mean, rstd, amax = norm_ops.norm_forward(x.reshape(-1, hdim), norm_weight, norm_bias, env.use_triton,
                                                      residual=r2, kind=kind, eps=eps, zero_centered=zero_centered,
                                                      tickets=env.tickets)
    y_scale = finalize_scale(amax, E4M3, env.use_triton)
    y8, _ = norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, env.use_triton,
                               zero_centered=zero_centered)
    return h, q, e, mean, rstd, y_scale, y8


def norm_backward(q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres, zero_centered, env: BlockEnv):
    """Norm backward from the saved FP8 copy (+ dres, the residual stream's gradient, added in the kernel):
    (dx [M, H], d norm weight, d norm bias | None, dx's stage-1 amax | None (with a hand-off)), the parameters'
    gradients in their dtypes."""
    out = norm_ops.norm_backward(q, e, mean, rstd, norm_weight, dy_norm, env.use_triton,
                                 dres=dres.reshape(q.shape) if dres is not None else None,
                                 has_bias=norm_bias is not None, zero_centered=zero_centered,
                                 partial_amax=env.handoff is not None, tickets=env.tickets)
    dx, dnw, dnb = out[:3]
    return (dx, dnw.to(norm_weight.dtype), (dnb.to(norm_bias.dtype) if dnb is not None else None),
            out[3] if env.handoff is not None else None)


def norm_linear_forward(x, residual, norm_weight, norm_bias, weight: WeightPieces, bias, cache, kind, eps,
                        zero_centered, env: BlockEnv):
    """linear(norm(x (+ residual))) -> (out, h shaped like x (None without a residual), q, e, mean, rstd, the GEMM
    input's scale, W's scale). The GEMM input is not kept: backward re-casts it from (q, e) with the same scale."""
    hdim, n = x.shape[-1], weight.shape[0]
    check_gemm_dims(hdim, n, "fp8_norm_linear")
    h, q, e, mean, rstd, y_scale, y8 = norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered,
                                                    env)
    w8, w_scale = weight_rows(weight, cache, env)
    out = fp8_gemm(y8, w8, y_scale, w_scale, output_dtype(x), bias, fast_accum=env.fast_accum)
    h = h.reshape(x.shape) if residual is not None else None
    return out.reshape(*x.shape[:-1], n), h, q, e, mean, rstd, y_scale, w_scale


def norm_linear_backward(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale,
                         weight: WeightOperand, zero_centered, out_dtype, need_dx, need_dw, bias_dtype,
                         env: BlockEnv):
    """-> (dx [M, H], d norm weight, d norm bias, dx's amax, dW, d bias); the norm's gradients come with dx."""
    def norm_out_t():
        return norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, env.use_triton,
                                  zero_centered=zero_centered, write_row=False, write_t=True)[1]

    dy_norm, dw, db = gemm_backward(dout, weight, w_scale, norm_out_t, y_scale, out_dtype, need_dx, need_dw,
                                    bias_dtype, env)
    dx = dnw = dnb = amax = None
    if need_dx:
        dx, dnw, dnb, amax = norm_backward(q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres, zero_centered,
                                           env)
    return dx, dnw, dnb, amax, dw, db


# ----------------------------------------------------------------------------------------- gated GLU, linear
# `activation`: the gate's activation, one of swiglu.ACTIVATIONS (silu: SwiGLU, gelu_tanh: GeGLU)
def swiglu_linear_forward(x, weight: WeightPieces, bias, cache, activation, env: BlockEnv):
    """linear(act(gate) * up), [gate | up] = x -> (out, gate/up as E4M3 1x16 (q, e), the product's scale, W's
    scale). The product and its FP8 copies are recomputed in backward."""
    f2, n = x.shape[-1], weight.shape[0]
    check_gemm_dims(f2 // 2, n, "fp8_swiglu_linear")
    q, e, amax, _ = swiglu.swiglu_forward(x.reshape(-1, f2), env.use_triton, activation=activation,
                                          tickets=env.tickets)
    p_scale = finalize_scale(amax, E4M3, env.use_triton)
    p8, _ = swiglu.swiglu_cast(q, e, p_scale, env.use_triton, activation=activation)
    w8, w_scale = weight_rows(weight, cache, env)
    out = fp8_gemm(p8, w8, p_scale, w_scale, output_dtype(x), bias, fast_accum=env.fast_accum)
    return out.reshape(*x.shape[:-1], n), q, e, p_scale, w_scale


def swiglu_linear_backward(dout, q, e, p_scale, w_scale, weight: WeightOperand, out_dtype, x_dtype, need_dx,
                           need_dw, bias_dtype, activation, env: BlockEnv):
    """-> (d[gate | up] [M, 2F] in x's dtype, its amax, dW, d bias)."""
    def product_t():
        return swiglu.swiglu_cast(q, e, p_scale, env.use_triton, activation=activation, write_row=False,
                                  write_t=True)[1]

    dp, dw, db = gemm_backward(dout, weight, w_scale, product_t, p_scale, out_dtype, need_dx, need_dw, bias_dtype, env)
    dx = amax = None
    if dp is not None:
        dx, amax = swiglu.swiglu_backward(q, e, dp, env.use_triton, activation=activation, tickets=env.tickets)
        dx = dx.to(x_dtype)
    return dx, amax, dw, db


# ---------------------------------------------------------------------------- norm -> fc1 -> gated GLU -> fc2
def norm_mlp_forward(x, residual, norm_weight, norm_bias, fc1: WeightPieces, b1, fc2: WeightPieces, b2, cache1,
                     cache2, kind, eps, zero_centered, activation, env: BlockEnv):
    """fc2(act(gate) * up), [gate | up] = fc1(norm(x (+ residual))) -> (out, h shaped like x (None without a
    residual), q, e, mean, rstd, fc1's input scale, fc1's weight scale, gate/up as E4M3 1x16 (qa, ea), fc2's input
    scale, fc2's weight scale)."""
    hdim, f2, n = x.shape[-1], fc1.shape[0], fc2.shape[0]
    check_gemm_dims(hdim, f2, "fp8_norm_swiglu_mlp fc1")
    check_gemm_dims(f2 // 2, n, "fp8_norm_swiglu_mlp fc2")
    h, q, e, mean, rstd, y_scale, y8 = norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered,
                                                    env)
    w1_8, w1_scale = weight_rows(fc1, cache1, env)
    out_dtype = output_dtype(x)
    a = fp8_gemm(y8, w1_8, y_scale, w1_scale, out_dtype, b1, fast_accum=env.fast_accum)
    del y8
    qa, ea, amax_p, _ = swiglu.swiglu_forward(a, env.use_triton, activation=activation, tickets=env.tickets)
    del a
    p_scale = finalize_scale(amax_p, E4M3, env.use_triton)
    p8, _ = swiglu.swiglu_cast(qa, ea, p_scale, env.use_triton, activation=activation)
    w2_8, w2_scale = weight_rows(fc2, cache2, env)
    out = fp8_gemm(p8, w2_8, p_scale, w2_scale, out_dtype, b2, fast_accum=env.fast_accum)
    h = h.reshape(x.shape) if residual is not None else None
    return (out.reshape(*x.shape[:-1], n), h, q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale)


def norm_mlp_backward(dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale,
                      w2_scale, fc1: WeightOperand, fc2: WeightOperand, zero_centered, out_dtype, b1_dtype, b2_dtype,
                      need_dx, need_dw1, need_db1, need_dw2, activation, env: BlockEnv):
    """Backward of norm -> fc1 -> gated GLU -> fc2 from fc2's output gradient dout (+ dres into the norm): (dx [M, H],
    d norm weight, d norm bias, dx's amax, dW1 (whole), d b1, dW2, d b2), None where not asked for. b1_dtype: fc1's
    bias dtype (None without one); b2_dtype: fc2's when its gradient is asked for. The norm's gradients come with
    dx. Without an fc1 bias, d[gate | up] goes straight to E5M2: a pass computing its partial amaxes (and, from the
    same loads, the product's transposed E4M3 copy for fc2's wgrad), then `swiglu_backward_cast` writing fc1's dgrad
    and wgrad operands; its BF16 copy is never written."""
    tri = env.use_triton
    need_db1 = need_db1 and b1_dtype is not None
    need_dyn = need_dx or need_dw1 or need_db1  # anything below fc2 (fc1 weight/bias, norm, input)
    dx = dnw = dnb = amax_dx = dw1 = db1 = dw2 = db2 = dp = p8_t = amax_da = None
    dy2 = dout.reshape(-1, dout.shape[-1])
    dout_amax = env.handoff.take(dout) if env.handoff is not None else None
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, tri, write_row=need_dyn, write_t=need_dw2, amax=dout_amax,
                                           tickets=env.tickets)
    if b2_dtype is not None:
        db2 = dy2.float().sum(0).to(b2_dtype)
    if need_dyn:  # fc2's dgrad first: the SwiGLU backward's amax pass then also writes fc2's wgrad operand p8_t
        dp = fp8_gemm(dy8, fc2.transposed(w2_scale, tri), dy_scale, w2_scale, out_dtype)
        del dy8
        if b1_dtype is None:  # d[gate | up] straight to E5M2 (a BF16 copy only if fc1 has a bias)
            amax_da, p8_t = swiglu.swiglu_backward_amax(qa, ea, dp, tri, activation=activation,
                                                        product_scale=p_scale if need_dw2 else None,
                                                        tickets=env.tickets)
    if need_dw2:
        if p8_t is None:
            p8_t = swiglu.swiglu_cast(qa, ea, p_scale, tri, activation=activation, write_row=False, write_t=True)[1]
        dw2 = fp8_gemm(dy8_t, p8_t, dy_scale, p_scale, fc2.like.dtype)
        del p8_t
    del dy8_t
    if not need_dyn:
        return dx, dnw, dnb, amax_dx, dw1, db1, dw2, db2
    if b1_dtype is not None:
        da, amax_da = swiglu.swiglu_backward(qa, ea, dp, tri, activation=activation, tickets=env.tickets)
        if need_db1:
            db1 = da.float().sum(0).to(b1_dtype)
        da8, da8_t, da_scale = quantize_tensor(da, E5M2, tri, write_row=need_dx, write_t=need_dw1, amax=amax_da,
                                               tickets=env.tickets)
        del da
    else:
        da_scale = finalize_scale(amax_da, E5M2, tri)
        da8, da8_t = swiglu.swiglu_backward_cast(qa, ea, dp, da_scale, tri, activation=activation, write_row=need_dx,
                                                 write_t=need_dw1)
    del dp
    if need_dw1:
        y8_t = norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, tri, zero_centered=zero_centered,
                                  write_row=False, write_t=True)[1]
        dw1 = fp8_gemm(da8_t, y8_t, da_scale, y_scale, fc1.like.dtype)
        del y8_t, da8_t
    if need_dx:
        dyn = fp8_gemm(da8, fc1.transposed(w1_scale, tri), da_scale, w1_scale, out_dtype)
        dx, dnw, dnb, amax_dx = norm_backward(q, e, mean, rstd, norm_weight, norm_bias, dyn, dres, zero_centered, env)
    return dx, dnw, dnb, amax_dx, dw1, db1, dw2, db2
