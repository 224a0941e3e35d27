"""SiLU and GELU (erf form, torch's default) on FP8 inputs: forward quantizes x to E4M3 1x16 groups (saved for
backward) and applies the activation to the dequantized values; backward reads only the FP8 copy and dy."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import E4M3
from .group_quant import SCALE_DTYPE, group_dequantize_reference, group_quantize_reference
from .tiles import GROUP, cdiv, check_group_dim, group_tile, load_group_tile, quantize_group_tile

ACTIVATIONS = {"silu": 0, "gelu": 1}
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x / (1.0 + tl.exp(-x))
    else:
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 0:
        s = 1.0 / (1.0 + tl.exp(-x))
        return s + x * s * (1.0 - s)
    else:
        return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@triton.jit
def _act_tile(pid, M, K, BM: tl.constexpr, G: tl.constexpr):
    n_g = tl.cdiv(K // 16, G)
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    return group_tile(rows, (pid % n_g) * G, M, K, K // 16, G)


@triton.jit
def _act_fwd_kernel(x_ptr, q_ptr, e_ptr, y_ptr, M, K, ACT: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    offs, eoffs, mask = _act_tile(tl.program_id(0), M, K, BM, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, e, xd = quantize_group_tile(x, 448.0, False)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(e_ptr + eoffs, e.to(tl.bfloat16), mask=mask)
    tl.store(y_ptr + offs, _act(xd, ACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(q_ptr, e_ptr, dy_ptr, dx_ptr, M, K, ACT: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    offs, eoffs, mask = _act_tile(tl.program_id(0), M, K, BM, G)
    xd = load_group_tile(q_ptr, e_ptr, offs, eoffs, mask)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + offs, (dy * _act_grad(xd, ACT)).to(dx_ptr.dtype.element_ty), mask=mask)


def act_reference(x, name):
    if name == "silu":
        return x / (1.0 + torch.exp(-x))
    return 0.5 * x * (1.0 + torch.erf(x * _INV_SQRT2))


def act_grad_reference(x, name):
    if name == "silu":
        s = 1.0 / (1.0 + torch.exp(-x))
        return s + x * s * (1.0 - s)
    return 0.5 * (1.0 + torch.erf(x * _INV_SQRT2)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)


BM, G, WARPS = 8, 16, 4  # one 1x16 group per thread


def _grid(m, k):
    return (cdiv(m, BM) * cdiv(k // GROUP, G),)


def _act_id(name):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def act_forward(x, name, use_triton: bool):
    """x [..., K] -> (y in x's dtype, codes fp8, scales bf16): y = act(dequantized 1x16 E4M3 copy of x)."""
    act = _act_id(name)
    if not use_triton:
        q, e = group_quantize_reference(x, E4M3)
        return act_reference(group_dequantize_reference(q, e, torch.float32), name).to(x.dtype), q, e
    k = x.shape[-1]
    check_group_dim(k)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=E4M3.dtype, device=x.device)
    e = torch.empty(m, k // GROUP, dtype=SCALE_DTYPE, device=x.device)
    y = torch.empty_like(x2)
    if m:
        _act_fwd_kernel[_grid(m, k)](x2, q, e, y, m, k, ACT=act, BM=BM, G=G, num_warps=WARPS)
    return y.reshape(x.shape), q.reshape(x.shape), e.reshape(*x.shape[:-1], k // GROUP)


def act_backward(q, e, dy, name, use_triton: bool):
    act = _act_id(name)
    if not use_triton:
        return (dy.float() * act_grad_reference(group_dequantize_reference(q, e, torch.float32), name)).to(dy.dtype)
    k = q.shape[-1]
    q2 = q.reshape(-1, k)
    m = q2.shape[0]
    dx = torch.empty(q2.shape, dtype=dy.dtype, device=q.device)
    if m:
        _act_bwd_kernel[_grid(m, k)](q2, e.reshape(m, -1), dy.reshape(m, k).contiguous(), dx, m, k, ACT=act,
                                     BM=BM, G=G, num_warps=WARPS)
    return dx.reshape(q.shape)
