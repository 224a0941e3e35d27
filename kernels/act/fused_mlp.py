"""norm -> fc1 -> gated GLU -> fc2 as one autograd node (TransformerEngine's LayerNormMLP with SwiGLU or GeGLU, on
COAT's FP8 flow), so that backward can take d[gate | up] straight to E5M2: a pass that computes its partial amaxes
(and, from the same loads, the product's transposed E4M3 copy for fc2's weight gradient), then
`swiglu_backward_cast` recomputing it into the row-major and transposed E5M2 operands of fc1's dgrad and wgrad. The
BF16 gradient is never written: 2 bytes per element less written and read than fp8_(add_)norm_linear followed by
fp8_swiglu_linear, with exactly their numerics and saved tensors.
"""
from __future__ import annotations

import torch

from . import block_bodies as body
from . import compiled_mlp, swiglu
from .block_parts import WeightLike, WeightOperand, block_env, hand_off, kept_weight, output_dtype, usable_cache
from .config import ActivationConfig
from .runtime import CoatRuntime
from .weights import WeightCache, WeightPieces, as_pieces


class _Fp8NormMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, b1, w2, b2, cache1, cache2, kind, eps, zero_centered,
                activation, env, *w1):
        fc1, fc2 = WeightPieces(w1), WeightPieces([w2])
        out, h, q, e, mean, rstd, y_scale, w1_scale, qa, ea, p_scale, w2_scale = body.norm_mlp_forward(
            x, residual, norm_weight, norm_bias, fc1, b1, fc2, b2, cache1, cache2, kind, eps, zero_centered, activation,
            env)
        ctx.activation = activation
        ctx.caches, ctx.likes = (cache1, cache2), (WeightLike(fc1), WeightLike(fc2))
        ctx.out_dtype, ctx.zero_centered, ctx.env = output_dtype(x), zero_centered, env
        ctx.has_residual, ctx.shape = residual is not None, x.shape
        ctx.b1_dtype = b1.dtype if b1 is not None else None
        ctx.b2_dtype = b2.dtype if b2 is not None else None
        kept1, kept2 = kept_weight(fc1, cache1, env), kept_weight(fc2, cache2, env)
        ctx.n_fc1_saved = len(kept1)
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale,
                              *kept1, *kept2)
        if residual is None:
            return out
        return out, h

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa, ea, p_scale, w2_scale, *kept = \
            ctx.saved_tensors
        n1 = ctx.n_fc1_saved
        fc1 = WeightOperand(ctx.likes[0], WeightPieces(kept[:n1]) if n1 else None, ctx.caches[0])
        fc2 = WeightOperand(ctx.likes[1], WeightPieces(kept[n1:]) if len(kept) > n1 else None, ctx.caches[1])
        need = ctx.needs_input_grad
        dx, dnw, dnb, amax, dw1, db1, dw2, db2 = body.norm_mlp_backward(
            dout, dh if ctx.has_residual else None, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w1_scale, qa,
            ea, p_scale, w2_scale, fc1, fc2, ctx.zero_centered, ctx.out_dtype, ctx.b1_dtype,
            ctx.b2_dtype if need[6] else None, any(need[:4]), any(need[14:]), need[4], need[5], ctx.activation,
            ctx.env)
        if dx is not None:
            dx = dx.reshape(ctx.shape)
            hand_off(ctx.env, dx, amax)
        return ((dx, dx if ctx.has_residual else None, dnw, dnb, db1, dw2, db2) + (None,) * 7
                + ctx.likes[0].split(dw1))


def fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None, *,
                        residual=None, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False, activation="silu",
                        config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
                        fc1_cache: WeightCache | None = None, fc2_cache: WeightCache | None = None):
    """fc2(act(gate) * up), [gate | up] = fc1(norm(h)), h = x (+ residual), act: `silu` (SwiGLU) or `gelu_tanh`
    (GeGLU). Returns y, or (y, h) with a residual (h as in fp8_add_norm_linear). fc1_weight may be row blocks, e.g.
    (gate_proj.weight, up_proj.weight)."""
    swiglu.check_activation(activation)
    if torch.compiler.is_compiling():
        return compiled_mlp.fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias, fc2_bias,
                                                residual, norm, eps, zero_centered_gamma, activation, config)
    return _Fp8NormMLP.apply(x, residual, norm_weight, norm_bias, fc1_bias, fc2_weight, fc2_bias,
                             usable_cache(fc1_cache, config, runtime), usable_cache(fc2_cache, config, runtime), norm,
                             eps, zero_centered_gamma, activation, block_env(x, config, runtime),
                             *as_pieces(fc1_weight).tensors)
