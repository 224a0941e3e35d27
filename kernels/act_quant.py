"""FP8 activation quantization: 1x16 groups (what non-linear layers save) and per-tensor (GEMM operands).

1x16 groups: one scale per 16 consecutive elements of the last dim, computed in fp32 as amax / FP8_MAX, rounded
UP to the next bf16 value (so nothing saturates) and stored as bf16; a group holding Inf/NaN gets a NaN scale and
dequantizes to NaN. benchmarks/bench_act_scale_dtype.py measured the choice (E4M3, relative L2 error): fp32
scales 0.0159-0.0223, bf16 0.0161-0.0225 (within 2.5%), power-of-two E8M0 bytes 0.0266-0.0280 (19-100% worse:
the group's largest element is no longer exact); bf16 costs 2/16 byte per element against 4/16 for fp32.

Per-tensor: scale = amax / FP8_MAX in fp32 (1 when amax = 0, NaN when the tensor holds Inf/NaN, so the GEMM that
consumes it returns NaN and the step's overflow check sees it). Group scaling: the kernel that produces a tensor
writes one partial amax per program (stage 1), `finalize_scale` reduces them on the device (stage 2), and a cast
kernel divides and casts, writing the row-major copy, the transposed copy (rows padded with zeros to a multiple
of 16, the K dim of the weight-gradient GEMM), or both.

Every op has a torch reference (CPU, and the test oracle) and a Triton kernel (CUDA; CPU tensors under
TRITON_INTERPRET=1 when asked). `use_triton(t)` picks: CUDA tensors -> Triton, CPU -> torch, unless
COAT_ACT_BACKEND=triton|torch forces one.
"""
from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from .formats import E5M2, get_format
from .triton_fp8 import round_to_fp8_grid, to_e4m3, to_e5m2

GROUP = 16
SCALE_DTYPE = torch.bfloat16  # storage of the 1x16 group scales


def use_triton(t: torch.Tensor) -> bool:
    forced = os.environ.get("COAT_ACT_BACKEND", "")
    if forced in ("triton", "torch"):
        return forced == "triton"
    return t.is_cuda


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def check_group_dim(k: int, what: str = "last dim"):
    if k % GROUP:
        raise ValueError(f"FP8 1x{GROUP} groups need the {what} to be a multiple of {GROUP}, got {k}")


# ----------------------------------------------------------------------------------------------- Triton helpers
@triton.jit
def fp8_cast(y, E5M2_OUT: tl.constexpr):
    if E5M2_OUT:
        return to_e5m2(y)
    else:
        return to_e4m3(y)


@triton.jit
def encode_group_scale(amax, bad, FP8_MAX: tl.constexpr):
    """fp32 scale >= amax / FP8_MAX rounded up to a bf16 value (stored exactly as bf16); 1 for an all-zero group,
    NaN for a group holding Inf/NaN."""
    bits = tl.maximum((amax / FP8_MAX).to(tl.int32, bitcast=True), 0x00800000)  # >= the smallest normal fp32
    scale = ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0, 1.0, scale)
    return tl.where(bad, float("nan"), scale)


@triton.jit
def quantize_groups(x, BM: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr, E5M2_OUT: tl.constexpr):
    """x fp32 [BM, BK] -> (FP8 codes [BM, BK], fp32 scales [BM, BK//16] (bf16-exact), dequantized fp32 [BM, BK])."""
    x3 = tl.reshape(x, (BM, BK // 16, 16))
    a3 = tl.abs(x3)
    bad = tl.max(((x3 != x3) | (a3 == float("inf"))).to(tl.int32), axis=2) > 0
    amax = tl.max(tl.where(a3 == a3, a3, 0.0), axis=2)
    scale = encode_group_scale(amax, bad, FP8_MAX)
    y3 = x3 / scale[:, :, None]
    q3 = fp8_cast(y3, E5M2_OUT)
    # the dequantized values come from the fp32 grid rounding (same values as the codes), not from converting the
    # in-register FP8 codes back: on the H100 that round trip after a reshape gave wrong values (triton 3.6)
    if E5M2_OUT:
        r3 = round_to_fp8_grid(y3, 2, -14, 57344.0)
    else:
        r3 = round_to_fp8_grid(y3, 3, -6, 448.0)
    deq = tl.reshape(r3 * scale[:, :, None], (BM, BK))
    return tl.reshape(q3, (BM, BK)), scale, deq


@triton.jit
def dequantize_groups(q, scale, BM: tl.constexpr, BK: tl.constexpr):
    """FP8 codes [BM, BK] and fp32 scales [BM, BK//16] -> fp32 [BM, BK]."""
    q3 = tl.reshape(q.to(tl.float32), (BM, BK // 16, 16))
    return tl.reshape(q3 * scale[:, :, None], (BM, BK))


@triton.jit
def dequantize_gathered(q_ptr, e_ptr, rows, cols, mask, K):
    """fp32 tile [BM, BN] of the 1x16 FP8 copy of a row-major [M, K] tensor, each element fetching its group's
    scale directly (no reshape: on the H100, kernels that reshaped and then wrote both a row-major and a
    transposed copy gave wrong transposed codes)."""
    q = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
    e = tl.load(e_ptr + rows[:, None] * (K // 16) + (cols // 16)[None, :], mask=mask, other=1.0)
    return q.to(tl.float32) * e.to(tl.float32)


@triton.jit
def tile_amax(y, mask):
    """max |y| over the masked tile; NaN if any element is Inf/NaN (stage 1 of group scaling)."""
    a = tl.abs(y)
    bad = tl.max(tl.where(mask & ((a != a) | (a == float("inf"))), 1, 0))
    amax = tl.max(tl.where(mask & (a == a), a, 0.0))
    return tl.where(bad > 0, float("nan"), amax)


@triton.jit
def store_cast(y, rows, cols, scale, out_ptr, out_t_ptr, M, N, M_PAD,
               WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr):
    """Cast tile y [BM, BN] (rows >= M already zero) with a per-tensor scale; write out [M, N] and/or out_t [N, M_PAD]."""
    if WRITE_ROW:
        q = fp8_cast(y / scale, E5M2_OUT)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], q, mask=(rows[:, None] < M) & (cols[None, :] < N))
    if WRITE_T:
        qt = fp8_cast(tl.trans(y) / scale, E5M2_OUT)  # transpose fp32, then cast (fp8 transposes miscompiled)
        tl.store(out_t_ptr + cols[:, None] * M_PAD + rows[None, :], qt,
                 mask=(cols[:, None] < N) & (rows[None, :] < M_PAD))


# ----------------------------------------------------------------------------------------------- Triton kernels
@triton.jit
def _group_scale_tile(rows, pid_k, M, K, BK: tl.constexpr):
    """Offsets and mask of the 1x16 group scales of a [rows, BK] tile at column block pid_k of an [M, K] tensor."""
    gcols = pid_k * (BK // 16) + tl.arange(0, BK // 16)
    return rows[:, None] * (K // 16) + gcols[None, :], (rows[:, None] < M) & (gcols[None, :] < K // 16)


@triton.jit
def store_group_scales(e_ptr, e, rows, pid_k, M, K, BK: tl.constexpr):
    offs, mask = _group_scale_tile(rows, pid_k, M, K, BK)
    tl.store(e_ptr + offs, e.to(tl.bfloat16), mask=mask)


@triton.jit
def load_group_scales(e_ptr, rows, pid_k, M, K, BK: tl.constexpr):
    offs, mask = _group_scale_tile(rows, pid_k, M, K, BK)
    return tl.load(e_ptr + offs, mask=mask, other=1.0).to(tl.float32)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, e_ptr, partial_ptr, M, K,
                        FP8_MAX: tl.constexpr, E5M2_OUT: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, e, _ = quantize_groups(x, BM, BK, FP8_MAX, E5M2_OUT)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    store_group_scales(e_ptr, e, rows, pid_k, M, K, BK)
    if WRITE_PARTIAL:
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_k, tile_amax(x, mask))


@triton.jit
def _group_dequant_kernel(q_ptr, e_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_k * BK + tl.arange(0, BK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    q = tl.load(q_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
    e = load_group_scales(e_ptr, rows, pid_k, M, K, BK)
    y = dequantize_groups(q, e, BM, BK)
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    amax = tl.zeros((BLOCK,), tl.float32)
    bad = tl.zeros((BLOCK,), tl.int32)
    for i in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        a = tl.abs(x)
        bad = tl.maximum(bad, ((a != a) | (a == float("inf"))).to(tl.int32))
        amax = tl.maximum(amax, tl.where(a == a, a, 0.0))
    tl.store(partial_ptr + pid, tl.where(tl.max(bad) > 0, float("nan"), tl.max(amax)))


@triton.jit
def _finalize_scale_kernel(partial_ptr, n, scale_ptr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)  # BLOCK >= n: one program reads every partial (the interpreter needs static loops)
    p = tl.load(partial_ptr + offs, mask=offs < n, other=0.0)
    m = tl.max(tl.where(p == p, p, 0.0))
    scale = tl.where(m > 0, m / FP8_MAX, 1.0)
    tl.store(scale_ptr, tl.where(tl.max((p != p).to(tl.int32)) > 0, float("nan"), scale))


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
def encode_group_scale_ref(amax: torch.Tensor, bad: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """bf16 scales >= amax / fp8_max (rounded up); 1 for all-zero groups; NaN for groups holding Inf/NaN."""
    bits = (amax.float() / fp8_max).view(torch.int32).clamp(min=0x00800000)
    scale = ((bits + 0xFFFF) & -65536).view(torch.float32)
    scale = torch.where(amax == 0, 1.0, scale)
    return torch.where(bad, float("nan"), scale).to(SCALE_DTYPE)


def group_quantize_ref(x, fmt="e4m3"):
    fmt = get_format(fmt)
    k = x.shape[-1]
    check_group_dim(k)
    x3 = x.float().reshape(*x.shape[:-1], k // GROUP, GROUP)
    bad = ~torch.isfinite(x3).all(-1)
    amax = x3.abs().nan_to_num(0.0, 0.0, 0.0).amax(-1)
    e = encode_group_scale_ref(amax, bad, fmt.max)
    q = fmt.quantize(x3 / e.float()[..., None])
    return q.reshape(x.shape), e


def group_dequantize_ref(q, e, dtype=torch.bfloat16):
    k = q.shape[-1]
    q3 = q.float().reshape(*q.shape[:-1], k // GROUP, GROUP)
    return (q3 * e.float()[..., None]).reshape(q.shape).to(dtype)


def tensor_scale_ref(x, fmt="e4m3") -> torch.Tensor:
    """fp32 0-dim per-tensor (dequantization) scale: amax / FP8_MAX; 1 if all zero; NaN if any Inf/NaN."""
    fmt = get_format(fmt)
    xf = x.float()
    if xf.numel() == 0:
        return torch.ones((), device=x.device)
    amax = xf.abs().amax()
    scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
    return torch.where(torch.isfinite(xf).all(), scale, torch.full_like(scale, float("nan")))


def cast_ref(x2d, scale, fmt="e4m3", write_row=True, write_t=False):
    """Per-tensor cast of fp32-able x [M, N]: (q [M, N] or None, q_t [N, pad16(M)] or None)."""
    fmt = get_format(fmt)
    q = fmt.quantize(x2d.float() / scale)
    q_t = None
    if write_t:
        m, n = q.shape
        q_t = torch.zeros(n, pad16(m), dtype=fmt.dtype, device=q.device)
        q_t[:, :m] = q.t()
    return (q if write_row else None), q_t


# ------------------------------------------------------------------------------------------------ public ops
GQ_BM, GQ_BK = 64, 64  # tiles and warps: best of the sweep in benchmarks/bench_llama_layer.py (H100)
CAST_BM, CAST_BN = 64, 128
AMAX_BLOCK, AMAX_ITERS, AMAX_WARPS = 4096, 4, 8
GQ_WARPS, CAST_WARPS = 4, 8


def group_quantize(x, fmt="e4m3", *, partial_amax=False, triton_kernels=None):
    """x [..., K] -> (codes fp8 [..., K], scales bf16 [..., K/16][, per-program amax partials])."""
    fmt = get_format(fmt)
    if not (use_triton(x) if triton_kernels is None else triton_kernels):
        q, e = group_quantize_ref(x, fmt)
        return (q, e, tensor_amax_partials_ref(x)) if partial_amax else (q, e)
    k = x.shape[-1]
    check_group_dim(k)
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=fmt.dtype, device=x.device)
    e = torch.empty(m, k // GROUP, dtype=SCALE_DTYPE, device=x.device)
    grid = (triton.cdiv(m, GQ_BM), triton.cdiv(k, GQ_BK))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    _group_quant_kernel[grid](x2, q, e, partial, m, k, FP8_MAX=fmt.max, E5M2_OUT=fmt is E5M2,
                              WRITE_PARTIAL=partial_amax, BM=GQ_BM, BK=GQ_BK, num_warps=GQ_WARPS)
    q, e = q.reshape(x.shape), e.reshape(*x.shape[:-1], k // GROUP)
    return (q, e, partial) if partial_amax else (q, e)


def group_dequantize(q, e, dtype=torch.bfloat16, *, triton_kernels=None):
    if not (use_triton(q) if triton_kernels is None else triton_kernels):
        return group_dequantize_ref(q, e, dtype)
    k = q.shape[-1]
    q2 = q.reshape(-1, k)
    y = torch.empty(q2.shape, dtype=dtype, device=q.device)
    grid = (triton.cdiv(q2.shape[0], GQ_BM), triton.cdiv(k, GQ_BK))
    _group_dequant_kernel[grid](q2, e.reshape(-1, k // GROUP), y, q2.shape[0], k, BM=GQ_BM, BK=GQ_BK,
                                num_warps=GQ_WARPS)
    return y.reshape(q.shape)


def tensor_amax_partials_ref(x):
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    return torch.where(torch.isfinite(xf).all(), amax, torch.full_like(amax, float("nan"))).reshape(1)


def amax_partials(x, *, triton_kernels=None):
    """Stage 1 for a tensor no kernel of ours produced: one partial amax per block of the flat tensor."""
    if not (use_triton(x) if triton_kernels is None else triton_kernels):
        return tensor_amax_partials_ref(x)
    x = x.contiguous()
    n = x.numel()
    partial = torch.empty(max(triton.cdiv(n, AMAX_BLOCK * AMAX_ITERS), 1), dtype=torch.float32, device=x.device)
    if n == 0:
        partial.zero_()
        return partial
    _amax_partial_kernel[(partial.numel(),)](x, partial, n, BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS, num_warps=AMAX_WARPS)
    return partial


def finalize_scale(partial, fmt="e4m3", *, triton_kernels=None):
    """Stage 2: the per-tensor dequantization scale (fp32 0-dim, on the device) from the partial amaxes."""
    fmt = get_format(fmt)
    if not (use_triton(partial) if triton_kernels is None else triton_kernels):
        amax = partial.nan_to_num(0.0, 0.0, 0.0).amax()
        scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
        return torch.where(partial.isnan().any(), torch.full_like(scale, float("nan")), scale)
    scale = torch.empty((), dtype=torch.float32, device=partial.device)
    n = partial.numel()
    _finalize_scale_kernel[(1,)](partial, n, scale, FP8_MAX=fmt.max, BLOCK=max(triton.next_power_of_2(n), 128),
                                 num_warps=8)
    return scale


def tensor_scale(x, fmt="e4m3", *, triton_kernels=None):
    return finalize_scale(amax_partials(x, triton_kernels=triton_kernels), fmt, triton_kernels=triton_kernels)


def cast(x2d, scale, fmt="e4m3", *, write_row=True, write_t=False, triton_kernels=None):
    """Divide-and-cast x [M, N] by a per-tensor scale: (q [M, N] | None, q_t [N, pad16(M)] | None)."""
    fmt = get_format(fmt)
    if not (use_triton(x2d) if triton_kernels is None else triton_kernels):
        return cast_ref(x2d, scale, fmt, write_row, write_t)
    x2d = x2d.contiguous()
    m, n = x2d.shape
    mp = pad16(m)
    q = torch.empty(m, n, dtype=fmt.dtype, device=x2d.device) if write_row else None
    q_t = torch.empty(n, mp, dtype=fmt.dtype, device=x2d.device) if write_t else None
    grid = (triton.cdiv(mp if write_t else m, CAST_BM), triton.cdiv(n, CAST_BN))
    _cast_kernel[grid](x2d, scale, q, q_t, m, n, mp, WRITE_ROW=write_row, WRITE_T=write_t,
                       E5M2_OUT=fmt is E5M2, BM=CAST_BM, BN=CAST_BN, num_warps=CAST_WARPS)
    return q, q_t


# Stage-1 amaxes of gradients handed from one block's backward to the next: a backward kernel that produces a
# gradient also writes its partial amaxes; the block that consumes that very tensor object (checked by identity
# and version, so an in-place change or a different tensor never reuses them) skips its own amax pass.
_GRAD_PARTIALS: list = []


def remember_partials(t: torch.Tensor, partial: torch.Tensor):
    _GRAD_PARTIALS[:] = [e for e in _GRAD_PARTIALS[-7:] if e[0]() is not None]
    _GRAD_PARTIALS.append((weakref.ref(t), t._version, partial))


def take_partials(t: torch.Tensor):
    for i, (ref, version, partial) in enumerate(_GRAD_PARTIALS):
        if ref() is t:
            del _GRAD_PARTIALS[i]
            return partial if t._version == version else None
    return None


def quantize_tensor(x2d, fmt="e4m3", *, write_row=True, write_t=False, partial=None, triton_kernels=None):
    """Per-tensor FP8 of x [M, N]: amax partials (unless given), scale, cast. Returns (q, q_t, scale)."""
    if partial is None:
        partial = amax_partials(x2d, triton_kernels=triton_kernels)
    scale = finalize_scale(partial, fmt, triton_kernels=triton_kernels)
    q, q_t = cast(x2d, scale, fmt, write_row=write_row, write_t=write_t, triton_kernels=triton_kernels)
    return q, q_t, scale
