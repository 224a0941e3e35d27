"""SwiGLU on FP8 inputs: x [M, 2F] = [gate | up] (Megatron's `chunk(2, -1)`), y = silu(gate) * up.

`swiglu_forward` quantizes gate and up to E4M3 1x16 groups (the only thing saved for backward), computes the
product from the DEQUANTIZED values and writes one partial amax of it per program (stage 1), optionally the BF16
product too. `swiglu_cast` recomputes the product from the FP8 copy and casts it per-tensor (the next GEMM's
input, row-major in forward; transposed in backward for the weight gradient, with the forward's scale), so the
product is never saved ("beyond COAT": recompute the cheap non-linears). `swiglu_backward` reads the FP8 copy and
dy and writes d[gate | up] in BF16 with its partial amax, or casts it straight to per-tensor E5M2 (and transpose).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import act_quant as aq
from .formats import E4M3, E5M2


@triton.jit
def _load_pair(q_ptr, e_ptr, rows, pid_f, M, F, BM: tl.constexpr, BF: tl.constexpr):
    """Dequantized gate and up tiles [BM, BF] (column block pid_f) from the FP8 1x16 copy of x [M, 2F]."""
    fcols = pid_f * BF + tl.arange(0, BF)
    mask = (rows[:, None] < M) & (fcols[None, :] < F)
    gd = aq.dequantize_gathered(q_ptr, e_ptr, rows, fcols, mask, 2 * F)
    ud = aq.dequantize_gathered(q_ptr, e_ptr, rows, fcols + F, mask, 2 * F)
    return gd, ud, mask


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu_fwd_kernel(x_ptr, q_ptr, e_ptr, out_ptr, partial_ptr, M, F, WRITE_OUT: tl.constexpr,
                       BM: tl.constexpr, BF: tl.constexpr):
    pid_m, pid_f = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    fcols = pid_f * BF + tl.arange(0, BF)
    mask = (rows[:, None] < M) & (fcols[None, :] < F)
    offs = rows[:, None] * (2 * F) + fcols[None, :]
    g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    gq, ge, gd = aq.quantize_groups(g, BM, BF, 448.0, False)
    uq, ue, ud = aq.quantize_groups(u, BM, BF, 448.0, False)
    tl.store(q_ptr + offs, gq, mask=mask)
    tl.store(q_ptr + offs + F, uq, mask=mask)
    gcols = pid_f * (BF // 16) + tl.arange(0, BF // 16)
    emask = (rows[:, None] < M) & (gcols[None, :] < F // 16)
    eoffs = rows[:, None] * (2 * F // 16) + gcols[None, :]
    tl.store(e_ptr + eoffs, ge.to(tl.bfloat16), mask=emask)
    tl.store(e_ptr + eoffs + F // 16, ue.to(tl.bfloat16), mask=emask)
    p = gd * _sigmoid(gd) * ud
    tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_f, aq.tile_amax(p, mask))
    if WRITE_OUT:
        tl.store(out_ptr + rows[:, None] * F + fcols[None, :], p.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_cast_kernel(q_ptr, e_ptr, scale_ptr, out_ptr, out_t_ptr, M, F, M_PAD, WRITE_ROW: tl.constexpr,
                        WRITE_T: tl.constexpr, BM: tl.constexpr, BF: tl.constexpr):
    pid_m, pid_f = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    fcols = pid_f * BF + tl.arange(0, BF)
    gd, ud, mask = _load_pair(q_ptr, e_ptr, rows, pid_f, M, F, BM, BF)
    p = tl.where(mask, gd * _sigmoid(gd) * ud, 0.0)
    aq.store_cast(p, rows, fcols.to(tl.int64), tl.load(scale_ptr), out_ptr, out_t_ptr, M, F, M_PAD,
                  WRITE_ROW, WRITE_T, False)


@triton.jit
def _swiglu_bwd_kernel(q_ptr, e_ptr, dy_ptr, dx_ptr, partial_ptr, scale_ptr, out_ptr, out_t_ptr, M, F, M_PAD,
                       CAST: tl.constexpr, WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr,
                       BM: tl.constexpr, BF: tl.constexpr):
    pid_m, pid_f = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    fcols = pid_f * BF + tl.arange(0, BF)
    gd, ud, mask = _load_pair(q_ptr, e_ptr, rows, pid_f, M, F, BM, BF)
    dy = tl.load(dy_ptr + rows[:, None] * F + fcols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(gd)
    silu = gd * s
    dg = tl.where(mask, dy * ud * (s + silu * (1.0 - s)), 0.0).to(tl.bfloat16)
    du = tl.where(mask, dy * silu, 0.0).to(tl.bfloat16)
    if CAST:
        scale = tl.load(scale_ptr)
        fc = fcols.to(tl.int64)
        aq.store_cast(dg.to(tl.float32), rows, fc, scale, out_ptr, out_t_ptr, M, 2 * F, M_PAD,
                      WRITE_ROW, WRITE_T, True)
        aq.store_cast(du.to(tl.float32), rows, fc + F, scale, out_ptr, out_t_ptr, M, 2 * F, M_PAD,
                      WRITE_ROW, WRITE_T, True)
    else:
        offs = rows[:, None] * (2 * F) + fcols[None, :]
        tl.store(dx_ptr + offs, dg.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + offs + F, du.to(dx_ptr.dtype.element_ty), mask=mask)
        a1 = aq.tile_amax(dg.to(tl.float32), mask)
        a2 = aq.tile_amax(du.to(tl.float32), mask)
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_f,
                 tl.where((a1 != a1) | (a2 != a2), float("nan"), tl.maximum(a1, a2)))


# ------------------------------------------------------------------------------------------- torch references
def _split_deq(q, e):
    xd = aq.group_dequantize_ref(q, e, torch.float32)
    return xd.chunk(2, -1)


def _sigmoid_ref(g):
    return 1.0 / (1.0 + torch.exp(-g))


def swiglu_product_ref(q, e):
    gd, ud = _split_deq(q, e)
    return gd * _sigmoid_ref(gd) * ud


def swiglu_grad_ref(q, e, dy):
    """BF16 d[gate | up] from the FP8 copy of x and dy."""
    gd, ud = _split_deq(q, e)
    s = _sigmoid_ref(gd)
    silu = gd * s
    dy = dy.float()
    return torch.cat([(dy * ud * (s + silu * (1.0 - s))).bfloat16(), (dy * silu).bfloat16()], -1)


# ------------------------------------------------------------------------------------------------ public ops
FWD_BM, FWD_WARPS, CAST_BM, CAST_WARPS = 16, 4, 64, 8  # best of the H100 sweep


def _tiles(f):
    bf = next(b for b in (128, 64, 32, 16) if f % b == 0)
    return FWD_BM, bf


def _check(x):
    if x.shape[-1] % 32:
        raise ValueError(f"SwiGLU input [..., 2F] needs F to be a multiple of 16, got 2F={x.shape[-1]}")


def swiglu_forward(x2d, *, write_out=False, triton_kernels=None):
    """x [M, 2F] -> (q fp8 [M, 2F], e bf16 [M, 2F/16], partial amax of the product, y [M, F] | None)."""
    _check(x2d)
    if not (aq.use_triton(x2d) if triton_kernels is None else triton_kernels):
        q, e = aq.group_quantize_ref(x2d, E4M3)
        p = swiglu_product_ref(q, e)
        return q, e, aq.tensor_amax_partials_ref(p), (p.to(x2d.dtype) if write_out else None)
    m, f2 = x2d.shape
    f = f2 // 2
    x2d = x2d.contiguous()
    q = torch.empty(m, f2, dtype=E4M3.dtype, device=x2d.device)
    e = torch.empty(m, f2 // aq.GROUP, dtype=aq.SCALE_DTYPE, device=x2d.device)
    out = torch.empty(m, f, dtype=x2d.dtype, device=x2d.device) if write_out else None
    bm, bf = _tiles(f)
    grid = (triton.cdiv(m, bm), f // bf)
    partial = (torch.empty if m else torch.zeros)(max(grid[0] * grid[1], 1), dtype=torch.float32, device=x2d.device)
    if m:
        _swiglu_fwd_kernel[grid](x2d, q, e, out, partial, m, f, WRITE_OUT=write_out, BM=bm, BF=bf,
                                 num_warps=FWD_WARPS)
    return q, e, partial, out


def swiglu_cast(q, e, scale, *, write_row=True, write_t=False, triton_kernels=None):
    """Per-tensor E4M3 of silu(gate) * up recomputed from the FP8 copy: (p8 [M, F] | None, p8_t [F, M16] | None)."""
    if not (aq.use_triton(q) if triton_kernels is None else triton_kernels):
        return aq.cast_ref(swiglu_product_ref(q, e), scale, E4M3, write_row, write_t)
    if write_row and write_t:  # one launch writing both gave wrong codes on the H100 (triton 3.6): two launches
        return (swiglu_cast(q, e, scale, triton_kernels=True)[0],
                swiglu_cast(q, e, scale, write_row=False, write_t=True, triton_kernels=True)[1])
    m, f2 = q.shape
    f = f2 // 2
    mp = aq.pad16(m)
    out = torch.empty(m, f, dtype=E4M3.dtype, device=q.device) if write_row else None
    out_t = torch.empty(f, mp, dtype=E4M3.dtype, device=q.device) if write_t else None
    bm, bf = CAST_BM, _tiles(f)[1]
    grid = (triton.cdiv(mp if write_t else m, bm), f // bf)
    _swiglu_cast_kernel[grid](q, e, scale, out, out_t, m, f, mp, WRITE_ROW=write_row, WRITE_T=write_t,
                              BM=bm, BF=bf, num_warps=CAST_WARPS)
    return out, out_t


def swiglu_backward(q, e, dy, *, triton_kernels=None):
    """-> (dx bf16 [M, 2F], partial amax of dx)."""
    if not (aq.use_triton(q) if triton_kernels is None else triton_kernels):
        dx = swiglu_grad_ref(q, e, dy)
        return dx, aq.tensor_amax_partials_ref(dx)
    m, f2 = q.shape
    f = f2 // 2
    dx = torch.empty(m, f2, dtype=torch.bfloat16, device=q.device)
    bm, bf = _tiles(f)
    grid = (triton.cdiv(m, bm), f // bf)
    partial = (torch.empty if m else torch.zeros)(max(grid[0] * grid[1], 1), dtype=torch.float32, device=q.device)
    if m:
        _swiglu_bwd_kernel[grid](q, e, dy.contiguous(), dx, partial, None, None, None, m, f, 0, CAST=False,
                                 WRITE_ROW=False, WRITE_T=False, BM=bm, BF=bf, num_warps=FWD_WARPS)
    return dx, partial


def swiglu_backward_cast(q, e, dy, scale, *, write_row=True, write_t=True, triton_kernels=None):
    """d[gate | up] recomputed and cast straight to per-tensor E5M2: (dx8 [M, 2F] | None, dx8_t [2F, M16] | None)."""
    if not (aq.use_triton(q) if triton_kernels is None else triton_kernels):
        return aq.cast_ref(swiglu_grad_ref(q, e, dy), scale, E5M2, write_row, write_t)
    m, f2 = q.shape
    f = f2 // 2
    mp = aq.pad16(m)
    out = torch.empty(m, f2, dtype=E5M2.dtype, device=q.device) if write_row else None
    out_t = torch.empty(f2, mp, dtype=E5M2.dtype, device=q.device) if write_t else None
    bm, bf = CAST_BM, _tiles(f)[1]
    grid = (triton.cdiv(mp if write_t else m, bm), f // bf)
    _swiglu_bwd_kernel[grid](q, e, dy.contiguous(), None, None, scale, out, out_t, m, f, mp, CAST=True,
                             WRITE_ROW=write_row, WRITE_T=write_t, BM=bm, BF=bf, num_warps=CAST_WARPS)
    return out, out_t
