"""Rotary position embedding (Llama's rotate-half form) fused with the q/k/v split of the QKV GEMM output; BF16,
part of the attention core that COAT keeps in BF16.

`rope_split(qkv, cos, sin, head_dim, kv_heads)`: qkv [T, (Hq + 2 Hkv) * D] (query heads, then key heads, then value
heads; grouped-query attention when Hkv < Hq) -> q [T, Hq * D], k and v [T, Hkv * D], three new contiguous tensors
(q and k rotated, v copied), so the GEMM output is freed and flash attention saves only q, k, v. Token t uses row
t % P of the fp32 tables cos, sin [P, D/2]: P = the sequence length for tables per position (`rope_tables`), or
P = T for tables gathered per token (position ids, scaled RoPE variants). Backward applies the inverse rotation and
writes d(qkv) in one buffer, with the partial amaxes of its E5M2 quantization. Nothing is saved but the tables.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E5M2
from .group_quant import amax_partials_reference
from .handoff import GradientAmaxHandoff
from .scaling import ScaleTickets, StageOneAmax, stage_two_args, store_partial
from .tiles import nanmax, tile_amax_of_zero_masked


@triton.jit
def _rope_kernel(s0, s1, s2, d0, d1, d2, cos_ptr, sin_ptr, partial_ptr, T, P, SRC_STRIDE_Q, SRC_STRIDE_KV,
                 DST_STRIDE_Q, DST_STRIDE_KV, NQ, NKV, HALF_D: tl.constexpr, SIGN: tl.constexpr,
                 WRITE_PARTIAL: tl.constexpr, BT: tl.constexpr, NH: tl.constexpr, ticket_ptr, scale_ptr, NP,
                 FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    """One launch for q, k and v (program_id(1) picks the source/destination pair; v is copied).
    Tile [BT tokens, NH heads, HALF_D pairs]; cos/sin are loaded at the tile's shape with a zero head stride (same
    layout as the data, L1 hits) rather than broadcast, which made the compiler shuffle the data tile."""
    pid_t, which, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src, dst = s0, d0
    heads, src_stride, dst_stride = NQ, SRC_STRIDE_Q, DST_STRIDE_Q
    if which == 1:
        src, dst = s1, d1
    if which == 2:
        src, dst = s2, d2
    if which > 0:
        heads, src_stride, dst_stride = NKV, SRC_STRIDE_KV, DST_STRIDE_KV
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)[:, None, None]
    hh = (pid_h * NH + tl.arange(0, NH))[None, :, None]
    i = tl.arange(0, HALF_D)[None, None, :]
    mask = (t < T) & (hh < heads)
    col = hh * (2 * HALF_D) + i
    x1 = tl.load(src + t * src_stride + col, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + t * src_stride + col + HALF_D, mask=mask, other=0.0).to(tl.float32)
    toff = (t % P) * HALF_D + i + hh * 0  # always inside the tables: no mask
    c = tl.load(cos_ptr + toff).to(tl.float32)
    s = tl.load(sin_ptr + toff).to(tl.float32) * SIGN
    rot = which < 2
    y1 = tl.where(rot, x1 * c - x2 * s, x1).to(dst.dtype.element_ty)
    y2 = tl.where(rot, x2 * c + x1 * s, x2).to(dst.dtype.element_ty)
    tl.store(dst + t * dst_stride + col, y1, mask=mask)
    tl.store(dst + t * dst_stride + col + HALF_D, y2, mask=mask)
    if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of d(qkv) by the QKV GEMM's backward (masked lanes: 0)
        a = nanmax(tile_amax_of_zero_masked(y1.to(tl.float32)), tile_amax_of_zero_masked(y2.to(tl.float32)))
        store_partial(partial_ptr, (which * tl.num_programs(2) + pid_h) * tl.num_programs(0) + pid_t, a, NP,
                      ticket_ptr, scale_ptr, FP8_MAX, FINAL)


def rope_tables(seq_len, head_dim, base=10000.0, device="cpu"):
    """fp32 cos, sin [seq_len, head_dim/2] of positions 0 .. seq_len - 1."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope_reference(x, cos, sin, head_dim, sign=1.0):
    """x [T, heads * D] -> rotated [T, heads * D] (sign=-1: the inverse rotation); token t uses table row t % P."""
    t, h = x.shape
    xf = x.float().reshape(t, h // head_dim, head_dim)
    pos = torch.arange(t, device=x.device) % cos.shape[0]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :] * sign
    a, b = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(t, h).to(x.dtype)


BT, NH, WARPS = 1, 16, 4  # tokens and heads per program (per thread: 8 pairs of one head and token)


def _grid(t, q_heads):
    return (triton.cdiv(t, BT), 3, triton.cdiv(q_heads, NH))


def _launch(srcs, src_strides, dsts, dst_strides, cos, sin, t, heads, head_dim, sign, kwargs):
    partials = kwargs.pop("partials")
    _rope_kernel[_grid(t, heads[0])](*srcs, *dsts, cos, sin, partials, t, cos.shape[0], *src_strides, *dst_strides,
                                     *heads, HALF_D=head_dim // 2, SIGN=sign, WRITE_PARTIAL=partials is not None,
                                     BT=BT, NH=NH, num_warps=WARPS, **kwargs)


class _RopeSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, head_dim, kv_heads, use_triton, handoff, tickets):
        t, width = qkv.shape
        hq = width // head_dim - 2 * kv_heads
        ctx.save_for_backward(cos, sin)
        ctx.head_dim, ctx.heads, ctx.use_triton, ctx.handoff, ctx.tickets = head_dim, (hq, kv_heads), use_triton, \
            handoff, tickets
        q_width, kv_width = hq * head_dim, kv_heads * head_dim
        if not use_triton:
            q, k, v = qkv.split((q_width, kv_width, kv_width), -1)
            return rope_reference(q, cos, sin, head_dim), rope_reference(k, cos, sin, head_dim), v.clone()
        qkv = qkv.contiguous()
        outs = [torch.empty(t, w, dtype=qkv.dtype, device=qkv.device) for w in (q_width, kv_width, kv_width)]
        if t:
            srcs = [qkv, qkv[:, q_width:], qkv[:, q_width + kv_width:]]
            _launch(srcs, (width, width), outs, (q_width, kv_width), cos, sin, t, (hq, kv_heads), head_dim, 1.0,
                    dict(partials=None, ticket_ptr=None, scale_ptr=None, NP=1, FP8_MAX=1.0, FINAL=False))
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        hq, hkv = ctx.heads
        d = ctx.head_dim
        t = dq.shape[0]
        if not ctx.use_triton:
            dqkv = torch.cat([rope_reference(dq, cos, sin, d, -1.0), rope_reference(dk, cos, sin, d, -1.0), dv], -1)
            if ctx.handoff is not None:
                ctx.handoff.give(dqkv, StageOneAmax(amax_partials_reference(dqkv)))
            return dqkv, None, None, None, None, None, None, None
        width = (hq + 2 * hkv) * d
        dqkv = torch.empty(t, width, dtype=dq.dtype, device=dq.device)
        grid = _grid(t, hq)
        partials = (torch.empty if t else torch.zeros)(max(grid[0] * grid[1] * grid[2], 1), dtype=torch.float32,
                                                       device=dq.device)
        kwargs, amax = stage_two_args(partials, E5M2 if t else None, ctx.tickets)
        if t:
            dsts = [dqkv, dqkv[:, hq * d:], dqkv[:, (hq + hkv) * d:]]
            _launch([g.contiguous() for g in (dq, dk, dv)], (hq * d, hkv * d), dsts, (width, width), cos, sin, t,
                    (hq, hkv), d, -1.0, dict(partials=partials, **kwargs))
        if ctx.handoff is not None:
            ctx.handoff.give(dqkv, amax)
        return dqkv, None, None, None, None, None, None, None


def rope_split(qkv, cos, sin, head_dim, kv_heads, use_triton: bool, *, handoff: GradientAmaxHandoff | None = None,
               tickets: ScaleTickets | None = None):
    """(q, k, v) of qkv [T, (Hq + 2 kv_heads) * head_dim], q and k rotated (see the module docstring)."""
    width = qkv.shape[-1]
    q_heads = width // head_dim - 2 * kv_heads
    if width % head_dim or head_dim % 2 or kv_heads < 1 or q_heads < kv_heads or q_heads % kv_heads:
        raise ValueError(f"qkv width {width} is not (q_heads + 2 * {kv_heads}) heads of an even head_dim {head_dim} "
                         "with q_heads a multiple of the kv heads")
    if cos.shape != sin.shape or cos.shape[-1] != head_dim // 2:
        raise ValueError(f"cos/sin tables must be [positions, {head_dim // 2}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    return _RopeSplit.apply(qkv, cos, sin, head_dim, kv_heads, use_triton, handoff, tickets)
