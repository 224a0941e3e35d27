"""Rotary position embedding (Llama's rotate-half form) fused with the q/k/v split of the QKV GEMM output; BF16,
part of the attention core that COAT keeps in BF16.

`rope_split(qkv, cos, sin, head_dim, kv_heads)`: qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq * D], k and v [T, Hkv * D],
three new contiguous tensors (q and k rotated, v copied), so the GEMM output is freed and flash attention saves only
q, k, v. Two layouts of the qkv columns (grouped-query attention when Hkv < Hq):
- "split" (Hugging Face's fused q/k/v): all query heads, then all key heads, then all value heads;
- "grouped" (Megatron's linear_qkv): per key/value group g, its Hq / Hkv query heads, its key head, its value head.
Token t uses row (t // rows_per_position) % P of the fp32 tables cos, sin [P, D/2]: P = the sequence length for
tables per position (`rope_tables`; rows_per_position = the batch size when tokens are sequence-major, as in
Megatron's [s, b] order), or P = T for tables gathered per token (position ids, scaled RoPE variants). Backward applies
the inverse rotation and writes d(qkv) in one buffer, in qkv's layout, with the partial amaxes of its E5M2
quantization. Nothing is saved but the tables.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ..formats import E5M2
from .group_quant import amax_partials_reference
from .handoff import GradientAmaxHandoff
from .scaling import ScaleTickets, StageOneAmax, stage_two_args, store_partial
from .tiles import cdiv, nanmax, tile_amax_of_zero_masked

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


def rope_tables(seq_len, head_dim, base=10000.0, device="cpu"):
    """fp32 cos, sin [seq_len, head_dim/2] of positions 0 .. seq_len - 1."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


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


class _RopeSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, lay, pos_div, use_triton, handoff, tickets):
        t = qkv.shape[0]
        ctx.save_for_backward(cos, sin)
        ctx.lay, ctx.pos_div, ctx.use_triton, ctx.handoff, ctx.tickets = lay, pos_div, use_triton, handoff, tickets
        if not use_triton:
            q, k, v = lay.split_reference(qkv)
            return (rope_reference(q, cos, sin, lay.d, 1.0, pos_div), rope_reference(k, cos, sin, lay.d, 1.0, pos_div),
                    v.clone())
        qkv = qkv.contiguous()
        outs = [torch.empty(t, h * lay.d, dtype=qkv.dtype, device=qkv.device) for h in (lay.hq, lay.hkv, lay.hkv)]
        if t:
            _launch(qkv, True, outs, lay, cos, sin, t, pos_div, 1.0,
                    dict(partials=None, ticket_ptr=None, scale_ptr=None, NP=1, FP8_MAX=1.0, FINAL=False))
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        lay, pos_div = ctx.lay, ctx.pos_div
        t = dq.shape[0]
        if not ctx.use_triton:
            dqkv = lay.join_reference(rope_reference(dq, cos, sin, lay.d, -1.0, pos_div),
                                      rope_reference(dk, cos, sin, lay.d, -1.0, pos_div), dv)
            if ctx.handoff is not None:
                ctx.handoff.give(dqkv, StageOneAmax(amax_partials_reference(dqkv)))
            return dqkv, None, None, None, None, None, None, None
        dqkv = torch.empty(t, lay.width, dtype=dq.dtype, device=dq.device)
        grid = _grid(t, lay.hq)
        partials = (torch.empty if t else torch.zeros)(max(grid[0] * grid[1] * grid[2], 1), dtype=torch.float32,
                                                       device=dq.device)
        kwargs, amax = stage_two_args(partials, E5M2 if t else None, ctx.tickets)
        if t:
            _launch(dqkv, False, [g.contiguous() for g in (dq, dk, dv)], lay, cos, sin, t, pos_div, -1.0,
                    dict(partials=partials, **kwargs))
        if ctx.handoff is not None:
            ctx.handoff.give(dqkv, amax)
        return dqkv, None, None, None, None, None, None, None


def rope_split(qkv, cos, sin, head_dim, kv_heads, use_triton: bool, *, layout: str = "split",
               rows_per_position: int = 1, handoff: GradientAmaxHandoff | None = None,
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
    if not isinstance(rows_per_position, int) or rows_per_position < 1:
        raise ValueError(f"rows_per_position must be a positive int, got {rows_per_position!r}")
    lay = QKVLayout(layout, q_heads, kv_heads, head_dim)
    if torch.compiler.is_compiling():
        from .compiled_ops import rope_split as compiled_rope_split  # compiled_ops imports this module
        return compiled_rope_split(qkv, cos, sin, head_dim, kv_heads, use_triton, layout, rows_per_position)
    return _RopeSplit.apply(qkv, cos, sin, lay, rows_per_position, use_triton, handoff, tickets)


class RopeTables:
    """The cos/sin tables of the last frequency tensor asked for, kept while that tensor is unchanged (the layers of
    one model share one rotary embedding: the tables are made once per forward, or once while it is cached)."""

    def __init__(self):
        self._key = None
        self._tables = None

    def of(self, freqs: torch.Tensor, positions: int, mscale: float = 1.0):
        """fp32 (cos, sin) [positions, F] * mscale of the first `positions` rows of freqs [P, F] (angles)."""
        if freqs.shape[0] < positions:
            raise ValueError(f"rotary frequencies cover {freqs.shape[0]} positions, the sequence has {positions}")
        key = (freqs._version, positions, mscale)
        if self._key is None or self._key[1:] != key or self._key[0]() is not freqs:
            angles = freqs[:positions].float()
            cos, sin = angles.cos(), angles.sin()
            if mscale != 1.0:
                cos, sin = cos * mscale, sin * mscale
            self._tables = (cos.contiguous(), sin.contiguous())
            self._key = (weakref.ref(freqs), *key)
        return self._tables
