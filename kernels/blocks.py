"""COAT's FP8 layer blocks: autograd functions whose inputs and outputs are BF16 (or fp32) tensors while
everything they save for backward is FP8 (COAT_METHOD.md section 2), with Triton kernels on CUDA and the torch
references on CPU (COAT_ACT_BACKEND=triton forces the kernels on CPU tensors under TRITON_INTERPRET=1).

What each block saves (docs/activations.md has the memory accounting):
- fp8_linear: the per-tensor E4M3 transposed copy of x (the weight-gradient GEMM operand), or nothing new with
  reuse_input=True (x itself, when something else keeps it anyway, e.g. the flash attention output); the weight
  is never copied for backward: backward re-casts it transposed with the forward's scale, or takes the cached
  copies of a WeightCache (made once per optimizer step, held by the cache, not by the graph).
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
"""
from __future__ import annotations

import torch

from . import act_norm, act_pointwise, act_quant as aq, act_swiglu
from .act_gemm import check_gemm_dims, fp8_gemm
from .formats import E4M3, E5M2

__all__ = ["WeightCache", "fp8_linear", "fp8_norm_linear", "fp8_add_norm_linear", "fp8_norm_swiglu_mlp",
           "fp8_swiglu", "fp8_swiglu_linear", "fp8_gelu", "fp8_silu"]


class WeightCache:
    """Per-tensor E4M3 copies of one weight (row-major for forward, transposed for dgrad), made once per optimizer
    step and reused by every micro-batch. Invalidated when the weight changes: an optimizer's in-place update bumps
    `weight._version`; a new storage changes `data_ptr()`. Call `invalidate()` after out-of-band changes (e.g. a
    `.data` assignment that keeps the storage)."""

    def __init__(self):
        self.invalidate()

    def invalidate(self):
        self._key = None
        self.scale = self.w8 = self.w8_t = None

    @staticmethod
    def _key_of(weight):
        return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)

    def holds(self, weight) -> bool:
        return self._key == self._key_of(weight)

    def _refresh(self, weight):
        key = self._key_of(weight)
        if key != self._key:
            self.invalidate()
            self._key = key
            self.scale = aq.tensor_scale(weight.detach(), E4M3)

    def rows(self, weight):
        """(w8 [N, K], scale)."""
        self._refresh(weight)
        if self.w8 is None:
            self.w8, _ = aq.cast(weight.detach(), self.scale, E4M3)
        return self.w8, self.scale

    def transposed(self, weight):
        """(w8_t [K, N], scale)."""
        self._refresh(weight)
        if self.w8_t is None:
            _, self.w8_t = aq.cast(weight.detach(), self.scale, E4M3, write_row=False, write_t=True)
        return self.w8_t, self.scale


def _weight_rows(weight, cache):
    if cache is not None:
        return cache.rows(weight)
    w8, _, scale = aq.quantize_tensor(weight.detach(), E4M3)
    return w8, scale


def _weight_transposed(weight, scale, cache, forward_scale):
    """W^T as E4M3 with the forward's scale: the cache's copy only if it still holds the forward's quantization
    (a later micro-batch's forward may have refilled it), else re-cast."""
    if cache is not None and cache.holds(weight) and cache.scale is forward_scale:
        return cache.transposed(weight)[0]
    return aq.cast(weight.detach(), scale, E4M3, write_row=False, write_t=True)[1]


def _out_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def _linear_backward(ctx, dy, weight, w_scale, in_scale, in_t_fn, need_dx):
    """Shared GEMM backward: (dgrad [M, K] | None, wgrad | None, bias grad | None). in_t_fn() -> input^T FP8."""
    need_dw = ctx.needs_input_grad[ctx.weight_index]
    dy2 = dy.reshape(-1, weight.shape[0])
    dy8, dy8_t, dy_scale = aq.quantize_tensor(dy2, E5M2, write_row=need_dx, write_t=need_dw,
                                              partial=aq.take_partials(dy))
    dx = dw = db = None
    if need_dx:
        w8_t = _weight_transposed(weight, w_scale, ctx.cache, ctx.forward_w_scale)
        dx = fp8_gemm(dy8, w8_t, dy_scale, w_scale, ctx.out_dtype)
    if need_dw:
        dw = fp8_gemm(dy8_t, in_t_fn(), dy_scale, in_scale, weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[ctx.weight_index + 1]:
        db = dy2.float().sum(0).to(ctx.bias_dtype)
    return dx, dw, db


def _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps, zero_centered):
    """Forward norm (+ residual add) of x [..., H]: the BF16 sum h, its 1x16 FP8 copy (q, e), row statistics, and the
    per-tensor E4M3 input of the next GEMM (scale, codes)."""
    hdim = x.shape[-1]
    r2 = residual.reshape(-1, hdim) if residual is not None else None
    h, q, e, mean, rstd, partial = act_norm.norm_forward(x.reshape(-1, hdim), norm_weight, norm_bias, residual=r2,
                                                         kind=kind, eps=eps, zero_centered=zero_centered)
    y_scale = aq.finalize_scale(partial, E4M3)
    y8, _ = act_norm.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale, zero_centered=zero_centered)
    return h, q, e, mean, rstd, y_scale, y8


def _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres):
    """Norm backward from the saved FP8 copy (+ the residual stream's gradient dres): (dx shaped as the block's
    input, d norm weight, d norm bias) in the parameters' dtypes; dx's partial amaxes go to the block consuming it."""
    dx, dnw, dnb, partial = act_norm.norm_backward(q, e, mean, rstd, norm_weight, dy_norm, dres=dres,
                                                   has_bias=norm_bias is not None, zero_centered=ctx.zero_centered,
                                                   partial_amax=True)
    dx = dx.reshape(ctx.shape)
    aq.remember_partials(dx, partial)
    return dx, dnw.to(norm_weight.dtype), (dnb.to(norm_bias.dtype) if dnb is not None else None)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, reuse_input):
        k, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(k, n, "fp8_linear")
        x2 = x.reshape(-1, k)
        x8, x8_t, x_scale = aq.quantize_tensor(x2, E4M3, write_t=not reuse_input)
        w8, w_scale = _weight_rows(weight, cache)
        ctx.forward_w_scale = w_scale  # identity check against the cache in backward
        ctx.out_dtype, ctx.cache, ctx.reuse_input, ctx.weight_index = _out_dtype(x), cache, reuse_input, 1
        ctx.has_bias, ctx.bias_dtype = bias is not None, (bias.dtype if bias is not None else None)
        ctx.save_for_backward(x if reuse_input else x8_t, weight, x_scale, w_scale)
        y = fp8_gemm(x8, w8, x_scale, w_scale, ctx.out_dtype, bias, fprop=True)
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        saved_x, weight, x_scale, w_scale = ctx.saved_tensors
        k = weight.shape[1]

        def input_t():
            if ctx.reuse_input:
                return aq.cast(saved_x.reshape(-1, k), x_scale, E4M3, write_row=False, write_t=True)[1]
            return saved_x

        dx, dw, db = _linear_backward(ctx, dy, weight, w_scale, x_scale, input_t,
                                      ctx.needs_input_grad[0])
        if dx is not None:
            dx = dx.reshape(*dy.shape[:-1], k)
        return dx, dw, db, None, None


def fp8_linear(x, weight, bias=None, *, weight_cache: WeightCache | None = None, reuse_input: bool = False):
    """y = x @ weight.T + bias with E4M3 x E4M3 per-tensor GEMMs. reuse_input=True saves x itself (no new memory
    when x is kept anyway, e.g. the attention output) and re-quantizes it in backward."""
    return _Fp8Linear.apply(x, weight, bias, weight_cache, reuse_input)


class _Fp8NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, weight, bias, cache, kind, eps, zero_centered,
                residual_out=False):
        hdim, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(hdim, n, "fp8_norm_linear")
        h, q, e, mean, rstd, y_scale, y8 = _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps,
                                                        zero_centered)
        w8, w_scale = _weight_rows(weight, cache)
        ctx.forward_w_scale = w_scale  # identity check against the cache in backward
        ctx.out_dtype, ctx.cache, ctx.weight_index, ctx.zero_centered = _out_dtype(x), cache, 4, zero_centered
        ctx.has_bias, ctx.bias_dtype = bias is not None, (bias.dtype if bias is not None else None)
        ctx.has_residual, ctx.residual_out, ctx.shape = residual is not None, residual_out, x.shape
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, weight, y_scale, w_scale)
        out = fp8_gemm(y8, w8, y_scale, w_scale, ctx.out_dtype, bias, fprop=True).reshape(*x.shape[:-1], n)
        if residual is not None:
            return out, h.reshape(x.shape)
        if residual_out:  # x itself, as the residual stream: its gradient joins the norm backward (no add)
            return out, x
        return out

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, weight, y_scale, w_scale = ctx.saved_tensors

        def norm_out_t():
            return act_norm.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale,
                                      zero_centered=ctx.zero_centered, write_row=False, write_t=True)[1]

        need_dx = any(ctx.needs_input_grad[:4])
        dy_norm, dw, db = _linear_backward(ctx, dout, weight, w_scale, y_scale,
                                           norm_out_t, need_dx)
        dx = dnw = dnb = None
        if need_dx:
            dres = dh.reshape(q.shape) if ((ctx.has_residual or ctx.residual_out) and dh is not None) else None
            dx, dnw, dnb = _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dy_norm, dres)
        return dx, (dx if ctx.has_residual else None), dnw, dnb, dw, db, None, None, None, None, None


def fp8_norm_linear(x, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                    zero_centered_gamma=False, weight_cache: WeightCache | None = None, residual_out: bool = False):
    """linear(norm(x)): saves x as E4M3 1x16 (+ row statistics); the GEMM input is recomputed in backward.
    residual_out=True returns (y, x'): x' is x (a view of it) to use as the residual stream; the gradient that
    reaches x' is added to the norm's input gradient inside the norm-backward kernel, instead of autograd adding
    the two gradients of x in a separate pass."""
    return _Fp8NormLinear.apply(x, None, norm_weight, norm_bias, weight, bias, weight_cache, norm, eps,
                                zero_centered_gamma, residual_out)


def fp8_add_norm_linear(x, residual, norm_weight, norm_bias, weight, bias=None, *, norm="rmsnorm", eps=1e-5,
                        zero_centered_gamma=False, weight_cache: WeightCache | None = None):
    """h = x + residual (BF16), y = linear(norm(h)) -> (y, h). One kernel writes h, its E4M3 1x16 copy (saved) and
    the norm's statistics; backward adds h's incoming gradient inside the norm-backward kernel."""
    return _Fp8NormLinear.apply(x, residual, norm_weight, norm_bias, weight, bias, weight_cache, norm, eps,
                                zero_centered_gamma)


class _Fp8NormMLP(torch.autograd.Function):
    """norm -> fc1 -> SwiGLU -> fc2 in one node, so that backward can take d[gate | up] straight to E5M2: a pass
    that computes its partial amaxes (and, from the same loads, the product's transposed E4M3 copy for fc2's
    weight gradient), then `swiglu_backward_cast` recomputing it into the row-major and
    transposed E5M2 operands of fc1's dgrad and wgrad (the BF16 gradient is never written; 2 bytes/element less
    written and read than the unfused blocks). Saves exactly what fp8_(add_)norm_linear + fp8_swiglu_linear save."""

    @staticmethod
    def forward(ctx, x, residual, norm_weight, norm_bias, w1, b1, w2, b2, cache1, cache2, kind, eps, zero_centered):
        hdim, f2, n = x.shape[-1], w1.shape[0], w2.shape[0]
        check_gemm_dims(hdim, f2, "fp8_norm_swiglu_mlp fc1")
        check_gemm_dims(f2 // 2, n, "fp8_norm_swiglu_mlp fc2")
        h, q, e, mean, rstd, y_scale, y8 = _norm_to_fp8(x, residual, norm_weight, norm_bias, kind, eps,
                                                        zero_centered)
        w1_8, w1_scale = _weight_rows(w1, cache1)
        out_dtype = _out_dtype(x)
        a = fp8_gemm(y8, w1_8, y_scale, w1_scale, out_dtype, b1, fprop=True)
        del y8
        qa, ea, pa, _ = act_swiglu.swiglu_forward(a)
        del a
        p_scale = aq.finalize_scale(pa, E4M3)
        p8, _ = act_swiglu.swiglu_cast(qa, ea, p_scale)
        w2_8, w2_scale = _weight_rows(w2, cache2)
        out = fp8_gemm(p8, w2_8, p_scale, w2_scale, out_dtype, b2, fprop=True).reshape(*x.shape[:-1], n)
        ctx.fwd_w1_scale, ctx.fwd_w2_scale = w1_scale, w2_scale  # identity checks against the caches
        ctx.cache1, ctx.cache2, ctx.out_dtype, ctx.zero_centered = cache1, cache2, out_dtype, zero_centered
        ctx.has_residual, ctx.shape = residual is not None, x.shape
        ctx.b1_dtype = b1.dtype if b1 is not None else None
        ctx.b2_dtype = b2.dtype if b2 is not None else None
        ctx.save_for_backward(q, e, mean, rstd, norm_weight, norm_bias, w1, w2, y_scale, w1_scale, qa, ea, p_scale,
                              w2_scale)
        if residual is None:
            return out
        return out, h.reshape(x.shape)

    @staticmethod
    def backward(ctx, dout, dh=None):
        q, e, mean, rstd, norm_weight, norm_bias, w1, w2, y_scale, w1_scale, qa, ea, p_scale, w2_scale = \
            ctx.saved_tensors
        need = ctx.needs_input_grad
        need_dx = any(need[:4])
        need_da = need_dx or need[4] or need[5]  # anything below fc2 (fc1 weight/bias, norm, input)
        # fc2
        dy2 = dout.reshape(-1, w2.shape[0])
        dy8, dy8_t, dy_scale = aq.quantize_tensor(dy2, E5M2, write_row=need_da, write_t=need[6],
                                                  partial=aq.take_partials(dout))
        dw2 = db2 = dp = p8_t = None
        if need[7] and ctx.b2_dtype is not None:
            db2 = dy2.float().sum(0).to(ctx.b2_dtype)
        dx = dres = dnw = dnb = dw1 = db1 = None
        if need_da:  # fc2's dgrad first: the SwiGLU backward's amax pass then also writes fc2's wgrad operand p8_t
            w2_8t = _weight_transposed(w2, w2_scale, ctx.cache2, ctx.fwd_w2_scale)
            dp = fp8_gemm(dy8, w2_8t, dy_scale, w2_scale, ctx.out_dtype)
            del dy8, w2_8t
            # SwiGLU: d[gate | up] straight to E5M2 (a BF16 copy only if fc1 has a bias to reduce)
            if ctx.b1_dtype is None and need[6]:
                partial, p8_t = act_swiglu.swiglu_backward_amax(qa, ea, dp, product_scale=p_scale)
            elif ctx.b1_dtype is None:
                partial = act_swiglu.swiglu_backward_amax(qa, ea, dp)
        if need[6]:
            if p8_t is None:
                p8_t = act_swiglu.swiglu_cast(qa, ea, p_scale, write_row=False, write_t=True)[1]
            dw2 = fp8_gemm(dy8_t, p8_t, dy_scale, p_scale, w2.dtype)
            del p8_t
        del dy8_t
        if not need_da:
            return dx, dres, dnw, dnb, dw1, db1, dw2, db2, None, None, None, None, None
        if ctx.b1_dtype is not None:
            da, partial = act_swiglu.swiglu_backward(qa, ea, dp)
            if need[5]:
                db1 = da.float().sum(0).to(ctx.b1_dtype)
            da8, da8_t, da_scale = aq.quantize_tensor(da, E5M2, write_row=need_dx, write_t=need[4], partial=partial)
            del da
        else:
            da_scale = aq.finalize_scale(partial, E5M2)
            da8, da8_t = act_swiglu.swiglu_backward_cast(qa, ea, dp, da_scale, write_row=need_dx, write_t=need[4])
        del dp
        if need[4]:
            y8_t = act_norm.norm_cast(q, e, mean, rstd, norm_weight, norm_bias, y_scale,
                                      zero_centered=ctx.zero_centered, write_row=False, write_t=True)[1]
            dw1 = fp8_gemm(da8_t, y8_t, da_scale, y_scale, w1.dtype)
            del y8_t, da8_t
        if need_dx:
            w1_8t = _weight_transposed(w1, w1_scale, ctx.cache1, ctx.fwd_w1_scale)
            dyn = fp8_gemm(da8, w1_8t, da_scale, w1_scale, ctx.out_dtype)
            del da8, w1_8t
            dres_in = dh.reshape(q.shape) if (ctx.has_residual and dh is not None) else None
            dx, dnw, dnb = _norm_input_grad(ctx, q, e, mean, rstd, norm_weight, norm_bias, dyn, dres_in)
            dres = dx if ctx.has_residual else None
        return dx, dres, dnw, dnb, dw1, db1, dw2, db2, None, None, None, None, None


def fp8_norm_swiglu_mlp(x, norm_weight, norm_bias, fc1_weight, fc2_weight, fc1_bias=None, fc2_bias=None, *,
                        residual=None, norm="rmsnorm", eps=1e-5, zero_centered_gamma=False,
                        fc1_cache: WeightCache | None = None, fc2_cache: WeightCache | None = None):
    """fc2(silu(gate) * up), [gate | up] = fc1(norm(h)), h = x (+ residual): TransformerEngine's LayerNormMLP
    with SwiGLU, on COAT's FP8 flow. Returns y, or (y, h) with a residual (h as in fp8_add_norm_linear). Same
    numerics and saved tensors as fp8_(add_)norm_linear followed by fp8_swiglu_linear; faster backward."""
    return _Fp8NormMLP.apply(x, residual, norm_weight, norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                             fc1_cache, fc2_cache, norm, eps, zero_centered_gamma)


class _Fp8SwigluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache):
        f2, n = x.shape[-1], weight.shape[0]
        check_gemm_dims(f2 // 2, n, "fp8_swiglu_linear")
        q, e, partial, _ = act_swiglu.swiglu_forward(x.reshape(-1, f2))
        p_scale = aq.finalize_scale(partial, E4M3)
        p8, _ = act_swiglu.swiglu_cast(q, e, p_scale)
        w8, w_scale = _weight_rows(weight, cache)
        ctx.forward_w_scale = w_scale  # identity check against the cache in backward
        ctx.out_dtype, ctx.cache, ctx.weight_index, ctx.shape, ctx.x_dtype = _out_dtype(x), cache, 1, x.shape, x.dtype
        ctx.has_bias, ctx.bias_dtype = bias is not None, (bias.dtype if bias is not None else None)
        ctx.save_for_backward(q, e, weight, p_scale, w_scale)
        return fp8_gemm(p8, w8, p_scale, w_scale, ctx.out_dtype, bias, fprop=True).reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dout):
        q, e, weight, p_scale, w_scale = ctx.saved_tensors

        def product_t():
            return act_swiglu.swiglu_cast(q, e, p_scale, write_row=False, write_t=True)[1]

        dp, dw, db = _linear_backward(ctx, dout, weight, w_scale, p_scale, product_t,
                                      ctx.needs_input_grad[0])
        dx = None
        if dp is not None:
            dx, partial = act_swiglu.swiglu_backward(q, e, dp)
            dx = dx.to(ctx.x_dtype).reshape(ctx.shape)
            if ctx.x_dtype == torch.bfloat16:
                aq.remember_partials(dx, partial)
        return dx, dw, db, None


def fp8_swiglu_linear(x, weight, bias=None, *, weight_cache: WeightCache | None = None):
    """linear(silu(gate) * up), [gate | up] = x.chunk(2, -1): saves gate/up as E4M3 1x16 and recomputes the
    product (and its transposed FP8 copy) in backward."""
    return _Fp8SwigluLinear.apply(x, weight, bias, weight_cache)


class _Fp8Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        f2 = x.shape[-1]
        q, e, _, y = act_swiglu.swiglu_forward(x.reshape(-1, f2), write_out=True)
        ctx.save_for_backward(q, e)
        ctx.shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(*x.shape[:-1], f2 // 2)

    @staticmethod
    def backward(ctx, dy):
        q, e = ctx.saved_tensors
        dx, _ = act_swiglu.swiglu_backward(q, e, dy.reshape(q.shape[0], -1))
        return dx.to(ctx.x_dtype).reshape(ctx.shape)


def fp8_swiglu(x):
    """silu(gate) * up with [gate | up] = x.chunk(2, -1); saves x as E4M3 1x16."""
    return _Fp8Swiglu.apply(x)


class _Fp8Pointwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        y, q, e = act_pointwise.act_forward(x, name)
        ctx.save_for_backward(q, e)
        ctx.name = name
        return y

    @staticmethod
    def backward(ctx, dy):
        q, e = ctx.saved_tensors
        return act_pointwise.act_backward(q, e, dy, ctx.name), None


def fp8_gelu(x):
    """GELU (erf form); saves x as E4M3 1x16."""
    return _Fp8Pointwise.apply(x, "gelu")


def fp8_silu(x):
    """SiLU; saves x as E4M3 1x16."""
    return _Fp8Pointwise.apply(x, "silu")
