"""The RoPE + q/k/v split kernel of `rope` (see its docstring for the layouts and the tables), with its torch
reference: `rope_forward` (packed qkv -> q, k, v) and `rope_backward` (dq, dk, dv -> packed d(qkv), optionally with
the partial amaxes of its E5M2 quantization), each on Triton or on torch (`rope_reference`, `QKVLayout`'s
split/join)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E5M2
from ..triton_fp8 import nanmax
from .group_quant import amax_partials_reference
from .scaling import ScaleTickets, StageOneAmax, stage_two_args, store_partial
from .tiles import cdiv, tile_amax_of_zero_masked

LAYOUTS = ("split", "grouped")


@triton.jit
def _rope_kernel(s0, s1, s2, d0, d1, d2, cos_ptr, sin_ptr, partial_ptr, T, P, POS_DIV, SRC_STRIDE_Q, SRC_STRIDE_KV,
                 DST_STRIDE_Q, DST_STRIDE_KV, SRC_HPG_Q, SRC_HPG_KV, SRC_GROUP, DST_HPG_Q, DST_HPG_KV, DST_GROUP,
                 NQ, NKV, HALF_D: tl.constexpr, SIGN: tl.constexpr, WRITE_PARTIAL: tl.constexpr, BT: tl.constexpr,
                 NH: tl.constexpr, ticket_ptr, scale_ptr, NP, FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    """One launch for q, k and v (program_id(1) picks the source/destination pair; v is copied).
    Head h of a source (destination) starts at column (h // HPG) * GROUP + (h % HPG) * D of its base pointer: HPG
    heads per group, GROUP columns between groups (one group of all heads for contiguous tensors).
    Tile [BT tokens, NH heads, HALF_D pairs]; cos/sin are loaded at the tile's shape with a zero head stride (same
    layout as the data, L1 hits) rather than broadcast, which made the compiler shuffle the data tile."""
    pid_t, which, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src, dst = s0, d0
    heads, src_stride, dst_stride = NQ, SRC_STRIDE_Q, DST_STRIDE_Q
    src_hpg, dst_hpg = SRC_HPG_Q, DST_HPG_Q
    if which == 1:
        src, dst = s1, d1
    if which == 2:
        src, dst = s2, d2
    if which > 0:
        heads, src_stride, dst_stride = NKV, SRC_STRIDE_KV, DST_STRIDE_KV
        src_hpg, dst_hpg = SRC_HPG_KV, DST_HPG_KV
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)[:, None, None]
    hh = (pid_h * NH + tl.arange(0, NH))[None, :, None]
    i = tl.arange(0, HALF_D)[None, None, :]
    mask = (t < T) & (hh < heads)
    src_col = (hh // src_hpg) * SRC_GROUP + (hh % src_hpg) * (2 * HALF_D) + i
    dst_col = (hh // dst_hpg) * DST_GROUP + (hh % dst_hpg) * (2 * HALF_D) + i
    x1 = tl.load(src + t * src_stride + src_col, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + t * src_stride + src_col + HALF_D, mask=mask, other=0.0).to(tl.float32)
    toff = ((t // POS_DIV) % P) * HALF_D + i + hh * 0  # always inside the tables: no mask
    c = tl.load(cos_ptr + toff).to(tl.float32)
    s = tl.load(sin_ptr + toff).to(tl.float32) * SIGN
    rot = which < 2
    y1 = tl.where(rot, x1 * c - x2 * s, x1).to(dst.dtype.element_ty)
    y2 = tl.where(rot, x2 * c + x1 * s, x2).to(dst.dtype.element_ty)
    tl.store(dst + t * dst_stride + dst_col, y1, mask=mask)
    tl.store(dst + t * dst_stride + dst_col + HALF_D, y2, mask=mask)
    if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of d(qkv) by the QKV GEMM's backward (masked lanes: 0)
        a = nanmax(tile_amax_of_zero_masked(y1.to(tl.float32)), tile_amax_of_zero_masked(y2.to(tl.float32)))
        store_partial(partial_ptr, (which * tl.num_programs(2) + pid_h) * tl.num_programs(0) + pid_t, a, NP,
                      ticket_ptr, scale_ptr, FP8_MAX, FINAL)


def rope_reference(x, cos, sin, head_dim, sign=1.0, rows_per_position=1):
    """x [T, heads * D] -> rotated [T, heads * D] (sign=-1: the inverse rotation); token t uses table row
    (t // rows_per_position) % P."""
    t, h = x.shape
    xf = x.float().reshape(t, h // head_dim, head_dim)
    pos = torch.div(torch.arange(t, device=x.device), rows_per_position, rounding_mode="floor") % cos.shape[0]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :] * sign
    a, b = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1).reshape(t, h).to(x.dtype)


class QKVLayout:
    """Where the q, k and v heads of a QKV row sit (see the module docstring)."""

    def __init__(self, layout: str, q_heads: int, kv_heads: int, head_dim: int):
        if layout not in LAYOUTS:
            raise ValueError(f"qkv layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.hq, self.hkv, self.d = layout, q_heads, kv_heads, head_dim
        self.width = (q_heads + 2 * kv_heads) * head_dim
        r = q_heads // kv_heads
        if layout == "split":
            self.offsets = (0, q_heads * head_dim, (q_heads + kv_heads) * head_dim)
            self.heads_per_group, self.group = (q_heads, kv_heads), 0
        else:
            self.offsets = (0, r * head_dim, (r + 1) * head_dim)
            self.heads_per_group, self.group = (r, 1), (r + 2) * head_dim

    def split_reference(self, qkv):
        """(q, k, v) views of qkv [T, width] (non-contiguous)."""
        t = qkv.shape[0]
        if self.layout == "split":
            return qkv.split((self.hq * self.d, self.hkv * self.d, self.hkv * self.d), -1)
        x = qkv.view(t, self.hkv, self.hq // self.hkv + 2, self.d)
        r = self.hq // self.hkv
        return x[:, :, :r].reshape(t, -1), x[:, :, r].reshape(t, -1), x[:, :, r + 1].reshape(t, -1)

    def join_reference(self, q, k, v):
        """The inverse of split_reference: one [T, width] tensor."""
        if self.layout == "split":
            return torch.cat([q, k, v], -1)
        t = q.shape[0]
        parts = [q.reshape(t, self.hkv, -1, self.d), k.reshape(t, self.hkv, 1, self.d),
                 v.reshape(t, self.hkv, 1, self.d)]
        return torch.cat(parts, 2).reshape(t, self.width)


BT, NH, WARPS = 1, 16, 4  # tokens and heads per program (per thread: 8 pairs of one head and token)


def _grid(t, q_heads):
    return (cdiv(t, BT), 3, cdiv(q_heads, NH))


def _launch(packed, packed_is_src, unpacked, lay: QKVLayout, cos, sin, t, pos_div, sign, kwargs):
    """packed: the [T, width] qkv tensor; unpacked: contiguous q, k, v. Forward reads packed, backward writes it."""
    partials = kwargs.pop("partials")
    ends = [packed[:, o:] for o in lay.offsets]
    packed_args = ((lay.width, lay.width), (*lay.heads_per_group, lay.group))
    unpacked_args = ((lay.hq * lay.d, lay.hkv * lay.d), (lay.hq, lay.hkv, 0))
    (srcs, (ss, sg)), (dsts, (ds, dg)) = (((ends, packed_args), (unpacked, unpacked_args)) if packed_is_src else
                                        ((unpacked, unpacked_args), (ends, packed_args)))
    _rope_kernel[_grid(t, lay.hq)](*srcs, *dsts, cos, sin, partials, t, cos.shape[0], pos_div, *ss, *ds, *sg, *dg,
                                   lay.hq, lay.hkv, HALF_D=lay.d // 2, SIGN=sign, WRITE_PARTIAL=partials is not None,
                                   BT=BT, NH=NH, num_warps=WARPS, **kwargs)


_NO_PARTIALS = dict(partials=None, ticket_ptr=None, scale_ptr=None, NP=1, FP8_MAX=1.0, FINAL=False)


def rope_forward(qkv, cos, sin, lay: QKVLayout, rows_per_position, use_triton: bool):
    """(q, k, v) of qkv [T, width]: new contiguous tensors, q and k rotated, v copied."""
    if not use_triton:
        q, k, v = lay.split_reference(qkv)
        return (rope_reference(q, cos, sin, lay.d, 1.0, rows_per_position),
                rope_reference(k, cos, sin, lay.d, 1.0, rows_per_position), v.clone())
    t = qkv.shape[0]
    qkv = qkv.contiguous()
    outs = [torch.empty(t, h * lay.d, dtype=qkv.dtype, device=qkv.device) for h in (lay.hq, lay.hkv, lay.hkv)]
    if t:
        _launch(qkv, True, outs, lay, cos, sin, t, rows_per_position, 1.0, dict(_NO_PARTIALS))
    return tuple(outs)


def rope_backward(dq, dk, dv, cos, sin, lay: QKVLayout, rows_per_position, use_triton: bool, with_amax: bool,
                  tickets: ScaleTickets | None = None):
    """(d(qkv) [T, width] in qkv's layout, its stage-1 amax for E5M2 | None): the inverse rotation of dq and dk, dv
    copied; with_amax: the kernel also writes the amax partials of d(qkv) (the reference computes them after)."""
    t = dq.shape[0]
    if not use_triton:
        dqkv = lay.join_reference(rope_reference(dq, cos, sin, lay.d, -1.0, rows_per_position),
                                  rope_reference(dk, cos, sin, lay.d, -1.0, rows_per_position), dv)
        return dqkv, (StageOneAmax(amax_partials_reference(dqkv)) if with_amax else None)
    dqkv = torch.empty(t, lay.width, dtype=dq.dtype, device=dq.device)
    grads = [g.contiguous() for g in (dq, dk, dv)]
    if not with_amax:
        if t:
            _launch(dqkv, False, grads, lay, cos, sin, t, rows_per_position, -1.0, dict(_NO_PARTIALS))
        return dqkv, None
    grid = _grid(t, lay.hq)
    partials = (torch.empty if t else torch.zeros)(max(grid[0] * grid[1] * grid[2], 1), dtype=torch.float32,
                                                   device=dq.device)
    kwargs, amax = stage_two_args(partials, E5M2 if t else None, tickets)
    if t:
        _launch(dqkv, False, grads, lay, cos, sin, t, rows_per_position, -1.0, dict(partials=partials, **kwargs))
    return dqkv, amax
