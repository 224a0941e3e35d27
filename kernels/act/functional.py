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
- fp8_gelu: its input as E4M3 1x16.
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

import torch

from . import block_bodies as body
from . import compiled_ops, pointwise, swiglu
from .block_parts import (DEFAULT_CONFIG, WeightLike, WeightOperand, block_env, hand_off, kept_weight,
                          output_dtype, usable_cache)
from .config import ActivationConfig
from .runtime import CoatRuntime
from .weights import WeightCache, WeightPieces, as_pieces

__all__ = ["fp8_linear", "fp8_norm_linear", "fp8_add_norm_linear", "fp8_swiglu_linear", "fp8_gelu"]


def save_weight(ctx, pieces: WeightPieces, cache, env) -> tuple:
    """Remember a block's GEMM weight for backward: its description on ctx, the tensors to save (returned)."""
    ctx.weight_like, ctx.cache = WeightLike(pieces), cache
    return kept_weight(pieces, cache, env)


def saved_weight(ctx, weights) -> WeightOperand:
    """The weight operand of backward, from what save_weight kept."""
    return WeightOperand(ctx.weight_like, WeightPieces(weights) if weights else None, ctx.cache)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, cache, reuse_input, env, *weights):
        pieces = WeightPieces(weights)
        y, x8_t, x_scale, w_scale = body.linear_forward(x, pieces, bias, cache, reuse_input, env)
        ctx.out_dtype, ctx.reuse_input, ctx.env = output_dtype(x), reuse_input, env
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x if reuse_input else x8_t, x_scale, w_scale, *save_weight(ctx, pieces, cache, env))
        return y

    @staticmethod
    def backward(ctx, dy):
        saved_x, x_scale, w_scale, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, db = body.linear_backward(dy, saved_x, x_scale, w_scale, saved_weight(ctx, weights), ctx.reuse_input,
                                          ctx.out_dtype, need[0], any(need[5:]),
                                          ctx.bias_dtype if need[1] else None, ctx.env)
        if dx is not None:
            dx = dx.reshape(*dy.shape[:-1], dx.shape[-1])
        return (dx, db, None, None, None) + ctx.weight_like.split(dw)

def fp8_linear(x, weight, bias=None, *, config: ActivationConfig | None = None, runtime: CoatRuntime | None = None,
               weight_cache: WeightCache | None = None, reuse_input: bool = False):
    """y = x @ weight.T + bias with E4M3 x E4M3 per-tensor GEMMs (weight: a tensor or row blocks of one).
    reuse_input=True saves x itself (no new memory when x is kept anyway, e.g. the attention output) and
    re-quantizes it in backward."""
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_linear(x, weight, bias, config, reuse_input)
    return _Fp8Linear.apply(x, bias, usable_cache(weight_cache, config, runtime), reuse_input,
                            block_env(x, config, runtime),
                            *as_pieces(weight).tensors)


class _Fp8NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, bias, cache, kind, eps, zero_centered, residual_out, env,
                *weights):
        pieces = WeightPieces(weights)
        out, h, q, e, mean, rstd, y_scale, w_scale = body.norm_linear_forward(
            x, residual, norm_weight, norm_bias, pieces, bias, cache, kind, eps, zero_centered, env)
        ctx.out_dtype, ctx.zero_centered, ctx.env = output_dtype(x), zero_centered, env
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.has_residual, ctx.residual_out, ctx.shape = residual is not None, residual_out, x.shape
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale,
                              *save_weight(ctx, pieces, cache, env))
        if residual is not None:
            return out, h
        if residual_out:  # x itself, as the residual stream: its gradient joins the norm backward (no add)
            return out, x
        return out

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        dres = dh if (ctx.has_residual or ctx.residual_out) else None
        dx, dnw, dnb, amax, dw, db = body.norm_linear_backward(
            dout, dres, q, e, mean, rstd, norm_weight, norm_bias, y_scale, w_scale, saved_weight(ctx, weights),
            ctx.zero_centered, ctx.out_dtype, any(need[:4]), any(need[11:]), ctx.bias_dtype if need[4] else None,
            ctx.env)
        if dx is not None:
            dx = dx.reshape(ctx.shape)
            hand_off(ctx.env, dx, amax)
        return ((dx, (dx if ctx.has_residual else None), dnw, dnb, db, None, None, None, None, None, None)
                + ctx.weight_like.split(dw))

def fp8_norm_linear(x, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, residual_out: bool = False, config: ActivationConfig | None = None,
                    runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(norm(x)): saves x as E4M3 1x16 (+ row statistics); the GEMM input is recomputed in backward.
    residual_out=True returns (y, x'): x' is x (a view of it) to use as the residual stream; the gradient that
    reaches x' is added to the norm's input gradient inside the norm-backward kernel, instead of autograd adding
    the two gradients of x in a separate pass."""
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_norm_linear(x, None, norm_weight, norm_bias, weight, bias, norm, eps,
                                            zero_centered_gamma, residual_out, config)
    return _Fp8NormLinear.apply(x, None, norm_weight, norm_bias, bias, usable_cache(weight_cache, config, runtime),
                                norm, eps, zero_centered_gamma, residual_out, block_env(x, config, runtime),
                                *as_pieces(weight).tensors)


def fp8_add_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                        zero_centered_gamma=False, config: ActivationConfig | None = None,
                        runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """h = x + residual (BF16), y = linear(norm(h)) -> (y, h). One kernel writes h, its E4M3 1x16 copy (saved) and
    the norm's statistics; backward adds h's incoming gradient inside the norm-backward kernel."""
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_norm_linear(x, residual, norm_weight, norm_bias, weight, bias, norm, eps,
                                            zero_centered_gamma, False, config)
    return _Fp8NormLinear.apply(x, residual, norm_weight, norm_bias, bias, usable_cache(weight_cache, config, runtime),
                                norm, eps, zero_centered_gamma, False, block_env(x, config, runtime),
                                *as_pieces(weight).tensors)


class _Fp8SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, cache, activation, env, *weights):
        pieces = WeightPieces(weights)
        out, q, e, p_scale, w_scale = body.swiglu_linear_forward(x, pieces, bias, cache, activation, env)
        ctx.out_dtype, ctx.shape, ctx.x_dtype, ctx.env = output_dtype(x), x.shape, x.dtype, env
        ctx.activation = activation
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(q, e, p_scale, w_scale, *save_weight(ctx, pieces, cache, env))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, e, p_scale, w_scale, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, amax, dw, db = body.swiglu_linear_backward(
            dout, q, e, p_scale, w_scale, saved_weight(ctx, weights), ctx.out_dtype, ctx.x_dtype, need[0],
            any(need[5:]), ctx.bias_dtype if need[1] else None, ctx.activation, ctx.env)
        if dx is not None:
            dx = dx.reshape(ctx.shape)
            if ctx.x_dtype == torch.bfloat16:
                hand_off(ctx.env, dx, amax)
        return (dx, db, None, None, None) + ctx.weight_like.split(dw)

def fp8_swiglu_linear(x, weight, bias=None, *, activation="silu", config: ActivationConfig | None = None,
                      runtime: CoatRuntime | None = None, weight_cache: WeightCache | None = None):
    """linear(act(gate) * up), [gate | up] = x.chunk(2, -1), act: `silu` (SwiGLU) or `gelu_tanh` (GeGLU): saves
    gate/up as E4M3 1x16 and recomputes the product (and its transposed FP8 copy) in backward."""
    swiglu.check_activation(activation)
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_swiglu_linear(x, weight, bias, activation, config)
    return _Fp8SwigluLinear.apply(x, bias, usable_cache(weight_cache, config, runtime), activation,
                                  block_env(x, config, runtime), *as_pieces(weight).tensors)


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
    if torch.compiler.is_compiling():
        return compiled_ops.fp8_act(x, "gelu", config)
    return _Fp8Pointwise.apply(x, "gelu", (config or DEFAULT_CONFIG).use_triton(x))
