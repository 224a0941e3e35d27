"""Rotary position embedding (Llama's rotate-half form) fused with the q/k/v split of the QKV GEMM output; BF16,
part of the attention core that COAT keeps in BF16.

`rope_split(qkv, cos, sin, seq_len)`: qkv [T, 3H] (T = batch * seq, position = t % seq) -> q, k, v, three new
contiguous [T, H] tensors (q and k rotated, v copied), so the GEMM output is freed and flash attention saves only
q, k, v. Backward applies the inverse rotation and writes d(qkv) [T, 3H] in one buffer. Nothing is saved but the
cos/sin tables.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import act_quant as aq
from .act_quant import nanmax, remember_partials, tensor_amax_partials_ref, tile_amax0, use_triton
from .formats import E5M2


@triton.jit
def _rope_kernel(s0, s1, s2, d0, d1, d2, cos_ptr, sin_ptr, partial_ptr, T, S, SRC_STRIDE, DST_STRIDE, NHEADS,
                 HALF_D: tl.constexpr, SIGN: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                 BT: tl.constexpr, NH: tl.constexpr, ticket_ptr, scale_ptr, NP, FP8_MAX: tl.constexpr,
                 FINAL: tl.constexpr):
    """One launch for q, k and v (program_id(1) picks the source/destination pair; v is copied).
    Tile [BT tokens, NH heads, HALF_D pairs]; cos/sin are loaded at the tile's shape with a zero head stride (same
    layout as the data, L1 hits) rather than broadcast, which made the compiler shuffle the data tile."""
    pid_t, which, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src, dst = s0, d0
    if which == 1:
        src, dst = s1, d1
    if which == 2:
        src, dst = s2, d2
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)[:, None, None]
    hh = (pid_h * NH + tl.arange(0, NH))[None, :, None]
    i = tl.arange(0, HALF_D)[None, None, :]
    mask = (t < T) & (hh < NHEADS)
    col = hh * (2 * HALF_D) + i
    x1 = tl.load(src + t * SRC_STRIDE + col, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + t * SRC_STRIDE + col + HALF_D, mask=mask, other=0.0).to(tl.float32)
    toff = (t % S) * HALF_D + i + hh * 0  # always inside the tables: no mask
    c = tl.load(cos_ptr + toff).to(tl.float32)
    s = tl.load(sin_ptr + toff).to(tl.float32) * SIGN
    rot = which < 2
    y1 = tl.where(rot, x1 * c - x2 * s, x1).to(dst.dtype.element_ty)
    y2 = tl.where(rot, x2 * c + x1 * s, x2).to(dst.dtype.element_ty)
    tl.store(dst + t * DST_STRIDE + col, y1, mask=mask)
    tl.store(dst + t * DST_STRIDE + col + HALF_D, y2, mask=mask)
    if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of d(qkv) by the QKV GEMM's backward (masked lanes: 0)
        a = nanmax(tile_amax0(y1.to(tl.float32)), tile_amax0(y2.to(tl.float32)))
        aq.store_partial(partial_ptr, (which * tl.num_programs(2) + pid_h) * tl.num_programs(0) + pid_t, a, NP,
                         ticket_ptr, scale_ptr, FP8_MAX, FINAL)


def rope_tables(seq_len, head_dim, base=10000.0, device="cpu"):
    """fp32 cos, sin [seq_len, head_dim/2]."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope_ref(x, cos, sin, seq_len, head_dim, sign=1.0):
    """x [T, H] -> rotated [T, H] (sign=-1: the inverse rotation)."""
    t, h = x.shape
    xf = x.float().reshape(t, h // head_dim, head_dim)
    pos = torch.arange(t, device=x.device) % seq_len
    c, s = cos[pos][:, None, :], sin[pos][:, None, :] * sign
    a, b = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(t, h).to(x.dtype)


BT, NH, WARPS = 1, 16, 4  # tokens and heads per program (per thread: 8 pairs of one head and token)


def _grid(t, h, head_dim):
    return (triton.cdiv(t, BT), 3, triton.cdiv(h // head_dim, NH))


def _launch(srcs, src_stride, dsts, dst_stride, cos, sin, t, seq_len, h, head_dim, sign, partial=None):
    _rope_kernel[_grid(t, h, head_dim)](*srcs, *dsts, cos, sin, partial, t, seq_len, src_stride, dst_stride,
                                        h // head_dim, HALF_D=head_dim // 2, SIGN=sign,
                                        WRITE_PARTIAL=partial is not None, BT=BT, NH=NH, num_warps=WARPS,
                                        **aq.partial_kwargs(partial if partial is not None else cos,
                                                            E5M2 if partial is not None else None))


class _RopeSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, seq_len, head_dim):
        t, h3 = qkv.shape
        h = h3 // 3
        ctx.save_for_backward(cos, sin)
        ctx.seq_len, ctx.head_dim = seq_len, head_dim
        if not use_triton(qkv):
            q, k, v = qkv.split(h, -1)
            return rope_ref(q, cos, sin, seq_len, head_dim), rope_ref(k, cos, sin, seq_len, head_dim), v.clone()
        qkv = qkv.contiguous()
        outs = [torch.empty(t, h, dtype=qkv.dtype, device=qkv.device) for _ in range(3)]
        if t:
            _launch([qkv[:, i * h:] for i in range(3)], h3, outs, h, cos, sin, t, seq_len, h, head_dim, 1.0)
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        t, h = dq.shape
        if not use_triton(dq):
            dqkv = torch.cat([rope_ref(dq, cos, sin, ctx.seq_len, ctx.head_dim, -1.0),
                              rope_ref(dk, cos, sin, ctx.seq_len, ctx.head_dim, -1.0), dv], -1)
            remember_partials(dqkv, tensor_amax_partials_ref(dqkv))
            return dqkv, None, None, None, None
        dqkv = torch.empty(t, 3 * h, dtype=dq.dtype, device=dq.device)
        grid = _grid(t, h, ctx.head_dim)
        partial = (torch.empty if t else torch.zeros)(max(grid[0] * grid[1] * grid[2], 1), dtype=torch.float32,
                                                      device=dq.device)
        if t:
            _launch([g.contiguous() for g in (dq, dk, dv)], h, [dqkv[:, i * h:] for i in range(3)], 3 * h, cos, sin,
                    t, ctx.seq_len, h, ctx.head_dim, -1.0, partial)
        remember_partials(dqkv, partial)
        return dqkv, None, None, None, None


def rope_split(qkv, cos, sin, seq_len, head_dim):
    return _RopeSplit.apply(qkv, cos, sin, seq_len, head_dim)
