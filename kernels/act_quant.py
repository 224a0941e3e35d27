"""FP8 activation quantization: 1x16 groups (what non-linear layers save) and per-tensor (GEMM operands).

1x16 groups: one scale per 16 consecutive elements of the last dim, computed in fp32 as amax / FP8_MAX, rounded
UP to the next bf16 value (so nothing saturates) and stored as bf16; a group holding Inf/NaN gets a NaN scale and
dequantizes to NaN. benchmarks/bench_act_scale_dtype.py measured the choice (E4M3, relative L2 error): fp32
scales 0.0159-0.0223, bf16 0.0161-0.0225 (within 2.5%), power-of-two E8M0 bytes 0.0266-0.0280 (19-100% worse:
the group's largest element is no longer exact); bf16 costs 2/16 byte per element against 4/16 for fp32.

Per-tensor: scale = amax / FP8_MAX in fp32 (1 when amax = 0, NaN when the tensor holds Inf/NaN, so the GEMM that
consumes it returns NaN and the step's overflow check sees it). Group scaling: the kernel that produces a tensor
writes one partial amax per program (stage 1) and, in the same launch, the last program to finish turns them into
the scale (stage 2, `store_partial`; `finalize_scale` returns that scale, or reduces partials that have none); a
cast kernel multiplies by 1/scale and casts, writing the row-major copy, the transposed copy (rows padded with
zeros to a multiple of 16, the K dim of the weight-gradient GEMM), or both.

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
def nanmax(a, b):
    """max that propagates NaN (combine function of the amax reductions)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def encode_group_scale(amax, FP8_MAX: tl.constexpr):
    """fp32 scale >= amax / FP8_MAX rounded up to a bf16 value (stored exactly as bf16); 1 for an all-zero group,
    NaN for a group holding Inf/NaN (amax Inf or NaN: the amax reductions propagate NaN)."""
    bits = tl.maximum((amax / FP8_MAX).to(tl.int32, bitcast=True), 0x00800000)  # >= the smallest normal fp32
    scale = ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
    scale = tl.where(amax == 0, 1.0, scale)
    return tl.where((amax != amax) | (amax == float("inf")), float("nan"), scale)


@triton.jit
def quantize_groups3(x3, FP8_MAX: tl.constexpr, E5M2_OUT: tl.constexpr, DEQ_CODES: tl.constexpr):
    """x fp32 [G, BM, 16] (one 1x16 group per [g, i, :]) -> (FP8 codes [G, BM, 16], fp32 scales [G, BM, 1]
    (bf16-exact), dequantized fp32 [G, BM, 16]). 3-D tiles need no reshape: each thread owns whole groups.
    DEQ_CODES: dequantize by converting the in-register codes back (~2 instructions/element): gave wrong values
    (NaN) on the H100 with triton 3.6, also without any reshape; so by default the values come from the fp32 grid
    rounding (~12 instructions/element, the same values as the codes)."""
    scale = encode_group_scale(tl.reduce(tl.abs(x3), 2, nanmax, keep_dims=True), FP8_MAX)
    y3 = x3 / scale  # (an IEEE reciprocal per group, div_rn, cost 30 more registers and ~12% of the SwiGLU forward)
    q3 = fp8_cast(y3, E5M2_OUT)
    if DEQ_CODES:
        r3 = q3.to(tl.float32)
    elif E5M2_OUT:
        r3 = round_to_fp8_grid(y3, 2, -14, 57344.0)
    else:
        r3 = round_to_fp8_grid(y3, 3, -6, 448.0)
    return q3, scale, r3 * scale


@triton.jit
def group_tile(rows, g0, M, K, NG, G: tl.constexpr):
    """3-D tile of G 1x16 groups (starting at group g0, valid below NG) of `rows` (int64) of a row-major [M, K]
    tensor: (element offsets [G, BM, 16], scale offsets [G, BM, 1], mask [G, BM, 1]). Groups come first: the
    compiler then spreads threads over groups both for the codes and for the scales (one each), so the
    dequantization needs no data exchange between threads (rows first: it moved the codes through shared memory)."""
    g = g0 + tl.arange(0, G)
    offs = g[:, None, None] * 16 + rows[None, :, None] * K + tl.arange(0, 16)[None, None, :]
    eoffs = g[:, None, None] + rows[None, :, None] * (K // 16)
    return offs, eoffs, (g[:, None, None] < NG) & (rows[None, :, None] < M)


@triton.jit
def load_groups(q_ptr, e_ptr, offs, eoffs, mask):
    """Dequantized fp32 [G, BM, 16] of the 1x16 FP8 copy (codes converted right after the load, no reshape)."""
    q = tl.load(q_ptr + offs, mask=mask, other=0.0)
    e = tl.load(e_ptr + eoffs, mask=mask, other=1.0)
    return q.to(tl.float32) * e.to(tl.float32)


@triton.jit
def tile_amax(y, mask):
    """max |y| over the masked tile; NaN if any element is Inf/NaN (stage 1 of group scaling)."""
    return tile_amax0(tl.where(mask, y, 0.0))


@triton.jit
def tile_amax0(y):
    """tile_amax of a tile whose masked-off elements are already zero."""
    m = tl.reduce(tl.abs(y), None, nanmax)
    return tl.where(m == float("inf"), float("nan"), m)


@triton.jit
def reduce_scale(partial_ptr, n, FP8_MAX: tl.constexpr, NB: tl.constexpr):
    """Stage 2: fp32 scale from the n <= NB * 2048 partial amaxes (1 when all zero, NaN when any partial is NaN).
    NB is a compile-time count (the interpreter cannot loop to a run-time bound); the loop is kept rolled, so
    the tail of the kernel that hosts it stays small."""
    m = tl.zeros((2048,), tl.float32)
    for b in tl.range(NB, loop_unroll_factor=1):
        offs = b * 2048 + tl.arange(0, 2048)
        m = nanmax(m, tl.load(partial_ptr + offs, mask=offs < n, other=0.0, volatile=True))
    mx = tl.reduce(m, 0, nanmax)
    return tl.where(mx != mx, float("nan"), tl.where(mx > 0, mx / FP8_MAX, 1.0))


@triton.jit
def store_partial(partial_ptr, idx, value, n, ticket_ptr, scale_ptr, FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    """Stage 1: this program's partial amax (value >= 0 or NaN; n = number of programs). FINAL: stage 2 in the same
    launch. ticket_ptr -> [ticket, running max]: each program folds its value into the running max (an integer
    atomic max on the bit pattern: order-preserving for non-negative values, NaN above Inf), then takes a ticket
    (release/acquire); the program with the last ticket turns the max into the scale and resets both words to 0
    for the next launch (no separate finalize kernel, and nothing to re-zero between CUDA-graph replays)."""
    tl.store(partial_ptr + idx, value)
    if FINAL:
        tl.atomic_max(ticket_ptr + 1, value.to(tl.int32, bitcast=True) & 0x7FFFFFFF, sem="relaxed")
        if tl.atomic_add(ticket_ptr, 1, sem="acq_rel") == n - 1:
            mx = tl.atomic_xchg(ticket_ptr + 1, 0, sem="acq_rel").to(tl.float32, bitcast=True)
            tl.store(scale_ptr, tl.where(mx != mx, float("nan"), tl.where(mx > 0, mx / FP8_MAX, 1.0)))
            tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def store_cast(y, rows, cols, scale, out_ptr, out_t_ptr, M, N, M_PAD,
               WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr):
    """Cast tile y [BM, BN] (rows >= M already zero) with a per-tensor scale; write out [M, N] and/or out_t [N, M_PAD]."""
    inv = tl.math.div_rn(1.0, scale)  # y * (1 / scale), the reference's rounding (cast_ref)
    if WRITE_ROW:
        q = fp8_cast(y * inv, E5M2_OUT)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], q, mask=(rows[:, None] < M) & (cols[None, :] < N))
    if WRITE_T:
        qt = fp8_cast(tl.trans(y) * inv, E5M2_OUT)  # transpose fp32, then cast (fp8 transposes miscompiled)
        tl.store(out_t_ptr + cols[:, None] * M_PAD + rows[None, :], qt,
                 mask=(cols[:, None] < N) & (rows[None, :] < M_PAD))


@triton.jit
def store_cast3(y, rows, g0, scale, out_ptr, out_t_ptr, M, N, M_PAD, G: tl.constexpr,
                WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, E5M2_OUT: tl.constexpr, T_MODE: tl.constexpr):
    """store_cast for a 3-D tile y [G, BM, 16] (groups g0.. of rows; rows >= M already zero): out [M, N] and/or
    out_t [N, M_PAD]. The transposed copy (fp32 transposed, then cast: fp8 transposes miscompiled): T_MODE 0 =
    permute to [G, 16, BM] and a 3-D store; 1 = [BM, G * 16] and a 2-D tl.trans; 2 = permute, reshape to 2-D."""
    j = tl.arange(0, 16)
    g = g0 + tl.arange(0, G)
    inv = tl.math.div_rn(1.0, scale)  # y * (1 / scale), the reference's rounding (cast_ref)
    if WRITE_ROW:
        q = fp8_cast(y * inv, E5M2_OUT)
        cols = g[:, None, None] * 16 + j[None, None, :]
        tl.store(out_ptr + rows[None, :, None] * N + cols, q, mask=(rows[None, :, None] < M) & (cols < N))
    if WRITE_T:
        if T_MODE == 0:
            qt = fp8_cast(tl.permute(y, (0, 2, 1)) * inv, E5M2_OUT)  # [G, 16, BM]
            cols = g[:, None, None] * 16 + j[None, :, None]
            tl.store(out_t_ptr + cols * M_PAD + rows[None, None, :], qt,
                     mask=(cols < N) & (rows[None, None, :] < M_PAD))
        else:
            if T_MODE == 1:
                yt = tl.trans(tl.reshape(tl.permute(y, (1, 0, 2)), (y.shape[1], G * 16)))
            else:
                yt = tl.reshape(tl.permute(y, (0, 2, 1)), (G * 16, y.shape[1]))
            c = g0 * 16 + tl.arange(0, G * 16)
            tl.store(out_t_ptr + c[:, None] * M_PAD + rows[None, :], fp8_cast(yt * inv, E5M2_OUT),
                     mask=(c[:, None] < N) & (rows[None, :] < M_PAD))


# ----------------------------------------------------------------------------------------------- Triton kernels
@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, e_ptr, partial_ptr, M, K,
                        FP8_MAX: tl.constexpr, E5M2_OUT: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
                        BM: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)  # flat grid, column blocks fastest: neighbouring programs read neighbouring bytes
    n_g = tl.cdiv(K // 16, G)
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, eoffs, mask = group_tile(rows, (pid % n_g) * G, M, K, K // 16, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, e, _ = quantize_groups3(x, FP8_MAX, E5M2_OUT, False)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(e_ptr + eoffs, e.to(tl.bfloat16), mask=mask)
    if WRITE_PARTIAL:
        tl.store(partial_ptr + pid, tile_amax(x, mask))


@triton.jit
def _group_dequant_kernel(q_ptr, e_ptr, y_ptr, M, K, BM: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)
    n_g = tl.cdiv(K // 16, G)
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, eoffs, mask = group_tile(rows, (pid % n_g) * G, M, K, K // 16, G)
    y = load_groups(q_ptr, e_ptr, offs, eoffs, mask)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


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
        # evict_first: read once; streaming through L2 without displacing other lines cut the dirty-L2 write-backs
        # it paid for (H100, do_bench: 62% -> 75% of copy bandwidth)
        x = tl.load(x_ptr + offs, mask=offs < N, other=0.0, eviction_policy="evict_first")
        acc = tl.maximum(acc, (x.to(it, bitcast=True) & sign_off).to(it))
    m = tl.max(acc, 0).to(it).to(dt, bitcast=True).to(tl.float32)
    store_partial(partial_ptr, pid, tl.where(m == float("inf"), float("nan"), m), NP, ticket_ptr, scale_ptr,
                  FP8_MAX, FINAL)


@triton.jit
def _finalize_scale_kernel(partial_ptr, n, scale_ptr, FP8_MAX: tl.constexpr, NB: tl.constexpr):
    tl.store(scale_ptr, reduce_scale(partial_ptr, n, FP8_MAX, NB))


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
    """Per-tensor cast of fp32-able x [M, N]: (q [M, N] or None, q_t [N, pad16(M)] or None). x is multiplied by the
    fp32 reciprocal of the scale (one multiply per element in the kernels, and bit-identical to them)."""
    fmt = get_format(fmt)
    q = fmt.quantize(x2d.float() * torch.reciprocal(scale.float()))
    q_t = None
    if write_t:
        m, n = q.shape
        q_t = torch.zeros(n, pad16(m), dtype=fmt.dtype, device=q.device)
        q_t[:, :m] = q.t()
    return (q if write_row else None), q_t


# ------------------------------------------------------------------------------------------------ public ops
# Tiles: one 1x16 group per thread (GQ_BM * GQ_G = 32 * GQ_WARPS) keeps every thread's loads in flight at once
# (with two groups per thread ptxas issued the second group's loads only after the first group's math).
GQ_BM, GQ_G, GQ_WARPS = 4, 32, 4
DEQ_CODES = False  # True gave wrong values on the H100 (triton 3.6): see quantize_groups3
CAST_BM, CAST_BN, CAST_WARPS = 64, 128, 8  # best of the H100 sweep (benchmarks/bench_llama_layer.py)
AMAX_BLOCK, AMAX_ITERS, AMAX_WARPS = 8192, 4, 16  # 32768 elements per program: few programs, few atomics


def _group_grid(m, k, bm, g):
    return (triton.cdiv(m, bm) * triton.cdiv(k // GROUP, g),)


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
    grid = _group_grid(m, k, GQ_BM, GQ_G)
    partial = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[grid](x2, q, e, partial, m, k, FP8_MAX=fmt.max, E5M2_OUT=fmt is E5M2,
                                  WRITE_PARTIAL=partial_amax, BM=GQ_BM, G=GQ_G, num_warps=GQ_WARPS)
    q, e = q.reshape(x.shape), e.reshape(*x.shape[:-1], k // GROUP)
    return (q, e, partial) if partial_amax else (q, e)


def group_dequantize(q, e, dtype=torch.bfloat16, *, triton_kernels=None):
    if not (use_triton(q) if triton_kernels is None else triton_kernels):
        return group_dequantize_ref(q, e, dtype)
    k = q.shape[-1]
    q2 = q.reshape(-1, k)
    y = torch.empty(q2.shape, dtype=dtype, device=q.device)
    if q2.shape[0]:
        _group_dequant_kernel[_group_grid(q2.shape[0], k, GQ_BM, GQ_G)](q2, e.reshape(-1, k // GROUP), y, q2.shape[0],
                                                                       k, BM=GQ_BM, G=GQ_G, num_warps=GQ_WARPS)
    return y.reshape(q.shape)


_TICKETS: dict = {}  # device -> (zeroed int32 [64, 4] pool, its 64 [ticket, max] views, launches so far)


def reduce_blocks(n):
    """NB of reduce_scale for n partials (a power of two, so few compiled variants)."""
    return triton.next_power_of_2(triton.cdiv(max(n, 1), 2048))


def final_scale_args(partial, fmt):
    """Kernel arguments for an in-launch stage 2 (store_partial with FINAL): (ticket, scale, FP8_MAX). The scale is
    attached to the partial tensor, so `finalize_scale(partial, fmt)` returns it without a launch. Tickets: a
    per-device pool of zeroed [ticket, max] pairs, used in turn (each launch leaves its pair at 0 again); rows of 4
    words keep every pair 16-byte aligned, so Triton compiles one variant, not one per alignment."""
    fmt = get_format(fmt)
    dev = partial.device
    pool = _TICKETS.get(dev)
    if pool is None:  # the views are made once: slicing a tensor costs ~7 us of host time per launch
        words = torch.zeros(64, 4, dtype=torch.int32, device=dev)
        pool = _TICKETS[dev] = [words, [words[i, :2] for i in range(64)], 0]
    ticket = pool[1][pool[2] % 64]
    pool[2] += 1
    scale = torch.empty((), dtype=torch.float32, device=dev)
    partial._coat_scale = (fmt.max, scale)
    return ticket, scale, fmt.max


def partial_kwargs(partial, fmt):
    """Keyword arguments of a kernel that writes partial amaxes through store_partial: with fmt, it also computes
    the scale for that format (finalize_scale(partial, fmt) then returns it); fmt None: partials only."""
    n = partial.numel()
    if fmt is None:
        return dict(ticket_ptr=None, scale_ptr=None, NP=n, FP8_MAX=1.0, FINAL=False)
    ticket, scale, fp8_max = final_scale_args(partial, fmt)
    return dict(ticket_ptr=ticket, scale_ptr=scale, NP=n, FP8_MAX=fp8_max, FINAL=True)


def tensor_amax_partials_ref(x):
    xf = x.float()
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    return torch.where(torch.isfinite(xf).all(), amax, torch.full_like(amax, float("nan"))).reshape(1)


def amax_partials(x, fmt=None, *, triton_kernels=None):
    """Stage 1 for a tensor no kernel of ours produced: one partial amax per block of the flat tensor; with fmt,
    stage 2 in the same launch (finalize_scale(partial, fmt) then launches nothing)."""
    if not (use_triton(x) if triton_kernels is None else triton_kernels):
        return tensor_amax_partials_ref(x)
    x = x.contiguous()
    n = x.numel()
    partial = torch.empty(max(triton.cdiv(n, AMAX_BLOCK * AMAX_ITERS), 1), dtype=torch.float32, device=x.device)
    if n == 0:
        partial.zero_()
        return partial
    ticket, scale, fp8_max = final_scale_args(partial, fmt) if fmt is not None else (None, None, 1.0)
    _amax_partial_kernel[(partial.numel(),)](x, partial, ticket, scale, n, partial.numel(), FP8_MAX=fp8_max,
                                             FINAL=fmt is not None, BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS,
                                             num_warps=AMAX_WARPS)
    return partial


def finalize_scale(partial, fmt="e4m3", *, triton_kernels=None):
    """Stage 2: the per-tensor dequantization scale (fp32 0-dim, on the device) from the partial amaxes."""
    fmt = get_format(fmt)
    if not (use_triton(partial) if triton_kernels is None else triton_kernels):
        amax = partial.nan_to_num(0.0, 0.0, 0.0).amax()
        scale = torch.where(amax > 0, amax / fmt.max, torch.ones_like(amax))
        return torch.where(partial.isnan().any(), torch.full_like(scale, float("nan")), scale)
    done = getattr(partial, "_coat_scale", None)
    if done is not None and done[0] == fmt.max:  # the producing kernel already reduced its partials
        return done[1]
    scale = torch.empty((), dtype=torch.float32, device=partial.device)
    _finalize_scale_kernel[(1,)](partial, partial.numel(), scale, FP8_MAX=fmt.max, NB=reduce_blocks(partial.numel()),
                                 num_warps=8)
    return scale


def tensor_scale(x, fmt="e4m3", *, triton_kernels=None):
    return finalize_scale(amax_partials(x, fmt, triton_kernels=triton_kernels), fmt, triton_kernels=triton_kernels)


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
        partial = amax_partials(x2d, fmt, triton_kernels=triton_kernels)
    scale = finalize_scale(partial, fmt, triton_kernels=triton_kernels)
    q, q_t = cast(x2d, scale, fmt, write_row=write_row, write_t=write_t, triton_kernels=triton_kernels)
    return q, q_t, scale
