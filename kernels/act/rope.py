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

from . import compiled_ops
from .handoff import GradientAmaxHandoff
from .rope_kernel import QKVLayout, rope_backward, rope_forward
from .scaling import ScaleTickets


class _RopeSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, lay, pos_div, use_triton, handoff, tickets):
        ctx.save_for_backward(cos, sin)
        ctx.lay, ctx.pos_div, ctx.use_triton, ctx.handoff, ctx.tickets = lay, pos_div, use_triton, handoff, tickets
        return rope_forward(qkv, cos, sin, lay, pos_div, use_triton)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        dqkv, amax = rope_backward(dq, dk, dv, cos, sin, ctx.lay, ctx.pos_div, ctx.use_triton,
                                   ctx.handoff is not None, ctx.tickets)
        if ctx.handoff is not None:
            ctx.handoff.give(dqkv, amax)
        return dqkv, None, None, None, None, None, None, None


def rope_tables(seq_len, head_dim, base=10000.0, device="cpu"):
    """fp32 cos, sin [seq_len, head_dim/2] of positions 0 .. seq_len - 1."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


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
        return compiled_ops.rope_split(qkv, cos, sin, head_dim, kv_heads, use_triton, layout, rows_per_position)
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
