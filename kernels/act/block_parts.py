"""What the FP8 blocks (`functional`, `fused_mlp`, and their custom ops in `compiled_ops`) share: the per-call
environment resolved from a config and a runtime, the FP8 weight operands (from a WeightCache or quantized now) and
what backward keeps of them, the GEMM backward, the norm forward/backward around the FP8 copy of the norm input, and
the SwiGLU MLP's backward from fc2 down to the norm output."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..formats import E4M3, E5M2
from . import norm as norm_ops
from . import swiglu
from .config import ActivationConfig
from .gemm import fp8_gemm
from .handoff import GradientAmaxHandoff
from .scaling import ScaleTickets, finalize_scale
from .tensor_quant import cast, quantize_tensor
from .weights import WeightPieces

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


def block_env(x, config, runtime) -> BlockEnv:
    config = config or DEFAULT_CONFIG
    return BlockEnv(config.use_triton(x), config.fprop_fast_accum, runtime.tickets if runtime else None,
                    runtime.handoff if runtime else None, torch.is_grad_enabled(),
                    config.transposed_weights == "forward")


def usable_cache(cache, config, runtime):
    if cache is None or runtime is None:
        return None
    return runtime.usable_cache(cache, config or DEFAULT_CONFIG)


def weight_rows(pieces: WeightPieces, cache, env):
    """(w8 [N, K], scale); a cache also makes the transposed copy now when a backward will need it and the config
    says so (transposed_weights="forward")."""
    if cache is not None:
        return cache.fill(pieces, env.use_triton, env.tickets,
                          transposed=env.grad_enabled and env.weight_t_in_forward)
    w8, _, scale = quantize_tensor(pieces.joined(), E4M3, env.use_triton, tickets=env.tickets)
    return w8, scale


def weight_transposed(cache, like, pieces: WeightPieces | None, scale, use_triton):
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


class WeightLike:
    """What a cached block remembers of its weight for backward: shape, dtype, device (not the tensors)."""

    def __init__(self, pieces: WeightPieces):
        self.shape, self.dtype, self.device, self.rows = pieces.shape, pieces.dtype, pieces.device, pieces.rows

    def split(self, grad):
        return tuple(grad.split(self.rows, 0)) if len(self.rows) > 1 else (grad,)


def keeps_weight(cache, env) -> bool:
    """Whether backward needs the weight itself: without a cache, or when the cache makes the transposed copy in
    backward."""
    return cache is None or not env.weight_t_in_forward


def keep_weights(ctx, pieces: WeightPieces, cache, env):
    """Tensors to save for the weight: the pieces (parameters, no copies) when backward needs them, else none."""
    ctx.weight_like = WeightLike(pieces)
    return pieces.tensors if keeps_weight(cache, env) else ()


def keep_two_weights(ctx, first: WeightPieces, cache1, second: WeightPieces, cache2, env):
    """keep_weights for a node with two GEMM weights: (tensors to save, how many belong to the first)."""
    ctx.weight_likes = (WeightLike(first), WeightLike(second))
    a = first.tensors if keeps_weight(cache1, env) else ()
    b = second.tensors if keeps_weight(cache2, env) else ()
    return a + b, len(a)


def output_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def gradient_amax(env, grad):
    return env.handoff.take(grad) if env.handoff is not None else None


def linear_backward(ctx, dy, pieces, w_scale, in_scale, in_t_fn, need_dx, need_dw, need_db):
    """Shared GEMM backward: (dgrad [M, K] | None, wgrad per weight piece | (None, ...), bias grad | None).
    in_t_fn() -> input^T FP8."""
    env, weight = ctx.env, ctx.weight_like
    dy2 = dy.reshape(-1, weight.shape[0])
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, env.use_triton, write_row=need_dx, write_t=need_dw,
                                           amax=gradient_amax(env, dy), tickets=env.tickets)
    dx = db = None
    dws = (None,) * len(weight.rows)
    if need_dx:
        dx = fp8_gemm(dy8, weight_transposed(ctx.cache, weight, pieces, w_scale, env.use_triton), dy_scale, w_scale,
                      ctx.out_dtype)
    if need_dw:
        dws = weight.split(fp8_gemm(dy8_t, in_t_fn(), dy_scale, in_scale, weight.dtype))
    if need_db:
        db = dy2.float().sum(0).to(ctx.bias_dtype)
    return dx, dws, db


def norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered, env):
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


def norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres):
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


def swiglu_mlp_backward(dout, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
                        fc1_t, fc2_t, *, zero_centered, use_triton, tickets, dout_amax, out_dtype, w1_dtype, w2_dtype,
                        b1_dtype, b2_dtype, need_dx, need_dw1, need_db1, need_dw2):
    """Backward of norm -> fc1 -> SwiGLU -> fc2 from fc2's output gradient dout down to the norm's output:
    (d norm output [M, H] | None, dW1 (whole) | None, d b1 | None, dW2 | None, d b2 | None). fc1_t() / fc2_t(): the
    transposed E4M3 weights (dgrad operands); b1_dtype: fc1's bias dtype (None without one); b2_dtype: fc2's when its
    gradient is asked for; dout_amax: dout's amax when the kernel producing it gave one. Without an fc1 bias,
    d[gate | up] goes straight to E5M2: a pass computing its partial amaxes (and, from the same loads, the product's
    transposed E4M3 copy for fc2's wgrad), then `swiglu_backward_cast` writing fc1's dgrad and wgrad operands."""
    tri = use_triton
    need_db1 = need_db1 and b1_dtype is not None
    need_da = need_dx or need_dw1 or need_db1  # anything below fc2 (fc1 weight/bias, norm, input)
    dyn = dw1 = db1 = dw2 = db2 = dp = p8_t = amax_da = None
    dy2 = dout.reshape(-1, dout.shape[-1])
    dy8, dy8_t, dy_scale = quantize_tensor(dy2, E5M2, tri, write_row=need_da, write_t=need_dw2, amax=dout_amax,
                                           tickets=tickets)
    if b2_dtype is not None:
        db2 = dy2.float().sum(0).to(b2_dtype)
    if need_da:  # fc2's dgrad first: the SwiGLU backward's amax pass then also writes fc2's wgrad operand p8_t
        dp = fp8_gemm(dy8, fc2_t(), dy_scale, w2_scale, out_dtype)
        del dy8
        if b1_dtype is None:  # d[gate | up] straight to E5M2 (a BF16 copy only if fc1 has a bias)
            amax_da, p8_t = swiglu.swiglu_backward_amax(qa, ea, dp, tri, product_scale=p_scale if need_dw2 else None,
                                                        tickets=tickets)
    if need_dw2:
        if p8_t is None:
            p8_t = swiglu.swiglu_cast(qa, ea, p_scale, tri, write_row=False, write_t=True)[1]
        dw2 = fp8_gemm(dy8_t, p8_t, dy_scale, p_scale, w2_dtype)
        del p8_t
    del dy8_t
    if not need_da:
        return dyn, dw1, db1, dw2, db2
    if b1_dtype is not None:
        da, amax_da = swiglu.swiglu_backward(qa, ea, dp, tri, tickets=tickets)
        if need_db1:
            db1 = da.float().sum(0).to(b1_dtype)
        da8, da8_t, da_scale = quantize_tensor(da, E5M2, tri, write_row=need_dx, write_t=need_dw1, amax=amax_da,
                                               tickets=tickets)
        del da
    else:
        da_scale = finalize_scale(amax_da, E5M2, tri)
        da8, da8_t = swiglu.swiglu_backward_cast(qa, ea, dp, da_scale, tri, write_row=need_dx, write_t=need_dw1)
    del dp
    if need_dw1:
        y8_t = norm_ops.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, tri, zero_centered=zero_centered,
                                  write_row=False, write_t=True)[1]
        dw1 = fp8_gemm(da8_t, y8_t, da_scale, y_scale, w1_dtype)
        del y8_t, da8_t
    if need_dx:
        dyn = fp8_gemm(da8, fc1_t(), da_scale, w1_scale, out_dtype)
    return dyn, dw1, db1, dw2, db2
