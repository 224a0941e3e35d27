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

from .act_quant import remember_partials, tensor_amax_partials_ref, tile_amax, use_triton


@triton.jit
def _rope_kernel(src_ptr, dst_ptr, cos_ptr, sin_ptr, partial_ptr, T, S, SRC_STRIDE, DST_STRIDE, HALF_H,
                 HALF_D: tl.constexpr, ROTATE: tl.constexpr, SIGN: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                 BT: tl.constexpr, BJ: tl.constexpr):
    pid_t, pid_j = tl.program_id(0), tl.program_id(1)
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    j = pid_j * BJ + tl.arange(0, BJ)  # pair index: head * HALF_D + i
    mask = (t[:, None] < T) & (j[None, :] < HALF_H)
    col1 = (j // HALF_D) * (2 * HALF_D) + j % HALF_D
    x1 = tl.load(src_ptr + t[:, None] * SRC_STRIDE + col1[None, :], mask=mask, other=0.0)
    x2 = tl.load(src_ptr + t[:, None] * SRC_STRIDE + col1[None, :] + HALF_D, mask=mask, other=0.0)
    if ROTATE:
        pos = t % S
        c = tl.load(cos_ptr + pos[:, None] * HALF_D + (j % HALF_D)[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF_D + (j % HALF_D)[None, :], mask=mask, other=0.0).to(tl.float32)
        s = s * SIGN
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        x1 = (a * c - b * s).to(dst_ptr.dtype.element_ty)
        x2 = (b * c + a * s).to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + t[:, None] * DST_STRIDE + col1[None, :], x1, mask=mask)
    tl.store(dst_ptr + t[:, None] * DST_STRIDE + col1[None, :] + HALF_D, x2, mask=mask)
    if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of d(qkv) by the QKV GEMM's backward
        a1 = tile_amax(x1.to(tl.float32), mask)
        a2 = tile_amax(x2.to(tl.float32), mask)
        tl.store(partial_ptr + pid_t * tl.num_programs(1) + pid_j,
                 tl.where((a1 != a1) | (a2 != a2), float("nan"), tl.maximum(a1, a2)))


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


BT, BJ = 4, 1024


def _grid(t, h):
    return (triton.cdiv(t, BT), triton.cdiv(h // 2, BJ))


def _launch(src, src_stride, dst, dst_stride, cos, sin, t, seq_len, h, head_dim, rotate, sign, partial=None):
    _rope_kernel[_grid(t, h)](src, dst, cos, sin, partial, t, seq_len, src_stride, dst_stride, h // 2,
                              HALF_D=head_dim // 2, ROTATE=rotate, SIGN=sign, WRITE_PARTIAL=partial is not None,
                              BT=BT, BJ=BJ, num_warps=4)


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
        for i, out in enumerate(outs):
            _launch(qkv[:, i * h:], h3, out, h, cos, sin, t, seq_len, h, head_dim, i < 2, 1.0)
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
        n = _grid(t, h)[0] * _grid(t, h)[1]
        partial = torch.empty(3 * n, dtype=torch.float32, device=dq.device)
        for i, g in enumerate((dq, dk, dv)):
            _launch(g.contiguous(), h, dqkv[:, i * h:], 3 * h, cos, sin, t, ctx.seq_len, h, ctx.head_dim, i < 2, -1.0,
                    partial[i * n:(i + 1) * n])
        remember_partials(dqkv, partial)
        return dqkv, None, None, None, None


def rope_split(qkv, cos, sin, seq_len, head_dim):
    return _RopeSplit.apply(qkv, cos, sin, seq_len, head_dim)
