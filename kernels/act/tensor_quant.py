"""Per-tensor FP8 quantization of GEMM operands: amax partials of a tensor no kernel of ours produced, and the
divide-and-cast pass writing the row-major copy (forward / dgrad operand), the transposed copy (rows zero-padded to
a multiple of 16: the K dim of the weight-gradient GEMM), or both.

Each op has a torch reference (the CPU path and the test oracle) and a Triton kernel; `use_triton` picks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import E5M2, get_format
from .group_quant import amax_partials_reference
from .scaling import ScaleTickets, StageOneAmax, finalize_scale, stage_two_args, store_partial
from .tiles import cdiv, pad16, store_cast


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, ticket_ptr, scale_ptr, N, NP, FP8_MAX: tl.constexpr,
                         FINAL: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """One partial amax per BLOCK * ITERS elements. On the bit patterns: |x| is the pattern with the sign bit
    cleared, and for non-negative IEEE values integer order is numeric order with Inf above every finite value and
    NaN above Inf, so an integer max needs no float conversion and no Inf/NaN tests (2-3 instructions/element)."""
    pid = tl.program_id(0)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    if dt.primitive_bitwidth == 16:
        it: tl.constexpr = tl.int16
        sign_off: tl.constexpr = 0x7FFF
    else:
        it: tl.constexpr = tl.int32
        sign_off: tl.constexpr = 0x7FFFFFFF
    acc = tl.zeros((BLOCK,), it)
    for i in tl.static_range(ITERS):  # unrolled: every load is issued before the first max
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        # evict_first: read once; streaming through L2 without displacing other lines saves dirty-L2 write-backs
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0, eviction_policy="evict_first")
        acc = tl.maximum(acc, (x.to(it, bitcast=True) & sign_off).to(it))
    m = tl.max(acc, 0).to(it).to(dt, bitcast=True).to(tl.float32)
    store_partial(partial_ptr, pid, tl.where(m == float("inf"), float("nan"), m), NP, ticket_ptr, scale_ptr,
                  FP8_MAX, FINAL)


@triton.jit
def _cast_kernel(x_ptr, scale_ptr, out_ptr, out_t_ptr, M, N, M_PAD,
                 WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    store_cast(x, rows.to(tl.int64), cols.to(tl.int64), tl.load(scale_ptr), out_ptr, out_t_ptr, M, N, M_PAD,
               WRITE_ROW, WRITE_T, E5M2_OUT)


# ------------------------------------------------------------------------------------------- torch references
def tensor_scale_reference(x, fmt="e4m3") -> torch.Tensor:
    """fp32 0-dim per-tensor (dequantization) scale: amax / FP8_MAX; 1 if all zero; NaN if any Inf/NaN."""
    fmt = get_format(fmt)
    xf = x.float()
    if xf.numel() == 0:
        return torch.ones((), device=x.device)
    amax = xf.abs().amax()  # Inf/NaN when x holds one (amax propagates NaN)
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def cast_reference(x2d, scale, fmt="e4m3", write_row=True, write_t=False):
    """Per-tensor cast of x [M, N]: (codes [M, N] or None, transposed codes [N, pad16(M)] or None). x is multiplied
    by the fp32 reciprocal of the scale (one multiply per element in the kernels, and bit-identical to them)."""
    fmt = get_format(fmt)
    codes = fmt.quantize(x2d.float() * torch.reciprocal(scale.float()))
    codes_t = None
    if write_t:
        m, n = codes.shape
        codes_t = torch.zeros(n, pad16(m), dtype=fmt.dtype, device=codes.device)
        codes_t[:, :m] = codes.t()
    return (codes if write_row else None), codes_t


# ------------------------------------------------------------------------------------------------ public ops
CAST_BM, CAST_BN, CAST_WARPS = 64, 128, 8  # best of the H100 tile sweep
AMAX_BLOCK, AMAX_ITERS, AMAX_WARPS = 8192, 4, 16  # 32768 elements per program: few programs, few atomics


def amax_partials(x, use_triton: bool, fmt=None, tickets: ScaleTickets | None = None) -> StageOneAmax:
    """Stage 1 for a tensor no kernel of ours produced: one partial amax per block of the flat tensor; with fmt,
    stage 2 in the same launch."""
    if not use_triton:
        return StageOneAmax(amax_partials_reference(x))
    x = x.contiguous()
    n = x.numel()
    partials = torch.empty(max(cdiv(n, AMAX_BLOCK * AMAX_ITERS), 1), dtype=torch.float32, device=x.device)
    if n == 0:
        partials.zero_()
        return StageOneAmax(partials)
    kwargs, amax = stage_two_args(partials, fmt, tickets)
    _amax_partial_kernel[(partials.numel(),)](x, partials, kwargs["ticket_ptr"], kwargs["scale_ptr"], n,
                                              partials.numel(), FP8_MAX=kwargs["FP8_MAX"], FINAL=kwargs["FINAL"],
                                              BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS, num_warps=AMAX_WARPS)
    return amax


def tensor_scale(x, fmt, use_triton: bool, tickets: ScaleTickets | None = None) -> torch.Tensor:
    return finalize_scale(amax_partials(x, use_triton, fmt, tickets), fmt, use_triton)


def cast(x2d, scale, fmt, use_triton: bool, *, write_row=True, write_t=False):
    """Divide-and-cast x [M, N] by a per-tensor scale: (codes [M, N] | None, transposed [N, pad16(M)] | None)."""
    fmt = get_format(fmt)
    if not use_triton:
        return cast_reference(x2d, scale, fmt, write_row, write_t)
    if write_row and write_t and x2d.element_size() != 2:
        # one launch writing both copies of a 32-bit source gave wrong transposed codes on the H100 (16-bit sources
        # are exact): two launches
        return cast(x2d, scale, fmt, True)[0], cast(x2d, scale, fmt, True, write_row=False, write_t=True)[1]
    x2d = x2d.contiguous()
    m, n = x2d.shape
    mp = pad16(m)
    codes = torch.empty(m, n, dtype=fmt.dtype, device=x2d.device) if write_row else None
    codes_t = torch.empty(n, mp, dtype=fmt.dtype, device=x2d.device) if write_t else None
    grid = (cdiv(mp if write_t else m, CAST_BM), cdiv(n, CAST_BN))
    _cast_kernel[grid](x2d, scale, codes, codes_t, m, n, mp, WRITE_ROW=write_row, WRITE_T=write_t,
                       E5M2_OUT=fmt is E5M2, BM=CAST_BM, BN=CAST_BN, num_warps=CAST_WARPS)
    return codes, codes_t


def quantize_tensor(x2d, fmt, use_triton: bool, *, write_row=True, write_t=False, amax: StageOneAmax | None = None,
                    tickets: ScaleTickets | None = None):
    """Per-tensor FP8 of x [M, N]: amax partials (unless given), scale, cast. Returns (codes, codes_t, scale)."""
    if amax is None:
        amax = amax_partials(x2d, use_triton, fmt, tickets)
    scale = finalize_scale(amax, fmt, use_triton)
    codes, codes_t = cast(x2d, scale, fmt, use_triton, write_row=write_row, write_t=write_t)
    return codes, codes_t, scale
