"""RMSNorm / LayerNorm on the FP8 1x16 copy of their input, emitting the per-tensor FP8 input of the next GEMM.

Forward (`norm_forward`, one kernel): optionally adds the residual (writing the BF16 sum h), quantizes h (or x)
to E4M3 1x16 groups (the copy saved for backward), normalizes the DEQUANTIZED values (so backward, which only has
the FP8 copy, recomputes exactly the forward's output), and writes per-row statistics and one partial amax of the
normalized output per program (stage 1 of group scaling). The normalized output itself is never written in BF16:
`norm_cast` recomputes it from the FP8 copy and casts it with the per-tensor scale, row-major (the forward GEMM
input) and/or transposed (the weight-gradient GEMM input, recomputed in backward with the forward's scale).
`norm_backward` reads the FP8 copy and the statistics, adds the residual-stream gradient, and emits dx, and the
per-program partial sums of the weight (and bias) gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import act_quant as aq
from .formats import E4M3


@triton.jit
def _normalize(xd, mean, rstd, w, b, mask, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    if IS_RMS:
        y = xd * rstd[:, None] * w[None, :]
    else:
        y = (xd - mean[:, None]) * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    return tl.where(mask, y, 0.0)


@triton.jit
def _load_gamma(w_ptr, b_ptr, cols, H, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    b = w
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _norm_fwd_kernel(x_ptr, res_ptr, h_ptr, q_ptr, e_ptr, mean_ptr, rstd_ptr, partial_ptr, w_ptr, b_ptr,
                     M, H, eps, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    cols = tl.arange(0, BH)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    offs = rows[:, None].to(tl.int64) * H + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
    q, e, xd = aq.quantize_groups(x, BM, BH, 448.0, False)
    tl.store(q_ptr + offs, q, mask=mask)
    aq.store_group_scales(e_ptr, e, rows.to(tl.int64), 0, M, H, BH)
    if IS_RMS:
        mean = tl.zeros((BM,), tl.float32)
        var = tl.sum(xd * xd, axis=1) / H
    else:
        mean = tl.sum(xd, axis=1) / H
        xc = tl.where(mask, xd - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / H
        tl.store(mean_ptr + rows, mean, mask=rows < M)
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    w, b = _load_gamma(w_ptr, b_ptr, cols, H, HAS_BIAS, ZERO_CENTERED)
    y = _normalize(xd, mean, rstd, w, b, mask, IS_RMS, HAS_BIAS)
    tl.store(partial_ptr + pid, aq.tile_amax(y, mask))


@triton.jit
def _norm_cast_kernel(q_ptr, e_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, scale_ptr, out_ptr, out_t_ptr, M, H, M_PAD,
                      IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                      WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    xd = aq.dequantize_gathered(q_ptr, e_ptr, rows.to(tl.int64), cols, mask, H)
    rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
    if IS_RMS:
        mean = rstd
    else:
        mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)
    w, b = _load_gamma(w_ptr, b_ptr, cols, H, HAS_BIAS, ZERO_CENTERED)
    y = _normalize(xd, mean, rstd, w, b, mask, IS_RMS, HAS_BIAS)
    aq.store_cast(y, rows.to(tl.int64), cols.to(tl.int64), tl.load(scale_ptr), out_ptr, out_t_ptr, M, H, M_PAD,
                  WRITE_ROW, WRITE_T, False)


@triton.jit
def _norm_bwd_kernel(q_ptr, e_ptr, mean_ptr, rstd_ptr, w_ptr, dy_ptr, dres_ptr, dx_ptr, dw_ptr, db_ptr, partial_ptr,
                     M, H, IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     WRITE_PARTIAL: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BH)
    w, _ = _load_gamma(w_ptr, w_ptr, cols, H, False, ZERO_CENTERED)
    dw = tl.zeros((1, BH), tl.float32)
    db = tl.zeros((1, BH), tl.float32)
    amax = tl.zeros((1, BH), tl.float32)
    bad = tl.zeros((1, BH), tl.int32)
    for r in range(ROWS):
        rows = pid * ROWS + r + tl.arange(0, 1)
        mask = (rows[:, None] < M) & (cols[None, :] < H)
        offs = rows[:, None].to(tl.int64) * H + cols[None, :]
        q = tl.load(q_ptr + offs, mask=mask, other=0.0)
        e = aq.load_group_scales(e_ptr, rows.to(tl.int64), 0, M, H, BH)
        xd = aq.dequantize_groups(q, e, 1, BH)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w[None, :]
        if IS_RMS:
            xhat = tl.where(mask, xd * rstd[:, None], 0.0)
            dx = (g - xhat * (tl.sum(g * xhat, axis=1) / H)[:, None]) * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)
            xhat = tl.where(mask, (xd - mean[:, None]) * rstd[:, None], 0.0)
            dx = (g - (tl.sum(g, axis=1) / H)[:, None] - xhat * (tl.sum(g * xhat, axis=1) / H)[:, None]) \
                * rstd[:, None]
        if HAS_DRES:
            dx = dx + tl.load(dres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx = dx.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + offs, dx, mask=mask)
        if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of dx by the next GEMM's backward
            a = tl.abs(dx.to(tl.float32))
            bad = tl.maximum(bad, (mask & ((a != a) | (a == float("inf")))).to(tl.int32))
            amax = tl.maximum(amax, tl.where(mask & (a == a), a, 0.0))
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(dw_ptr + pid.to(tl.int64) * H + cols[None, :], dw, mask=cols[None, :] < H)
    if HAS_BIAS:
        tl.store(db_ptr + pid.to(tl.int64) * H + cols[None, :], db, mask=cols[None, :] < H)
    if WRITE_PARTIAL:
        tl.store(partial_ptr + pid, tl.where(tl.max(bad) > 0, float("nan"), tl.max(amax)))


# ------------------------------------------------------------------------------------------- torch references
def _gamma(weight, bias, zero_centered):
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return w, (bias.float() if bias is not None else None)


def _stats_ref(xd, is_rms, eps):
    if is_rms:
        return None, 1.0 / torch.sqrt((xd * xd).mean(-1) + eps)
    mean = xd.mean(-1)
    return mean, 1.0 / torch.sqrt(((xd - mean[:, None]) ** 2).mean(-1) + eps)


def _normalize_ref(xd, mean, rstd, weight, bias, zero_centered):
    w, b = _gamma(weight, bias, zero_centered)
    xhat = xd * rstd[:, None] if mean is None else (xd - mean[:, None]) * rstd[:, None]
    y = xhat * w
    return y + b if b is not None else y


def norm_forward_ref(x, weight, bias, residual, is_rms, eps, zero_centered):
    h = (x + residual) if residual is not None else None
    q, e = aq.group_quantize_ref(h if h is not None else x, E4M3)
    xd = aq.group_dequantize_ref(q, e, torch.float32)
    mean, rstd = _stats_ref(xd, is_rms, eps)
    y = _normalize_ref(xd, mean, rstd, weight, bias, zero_centered)
    return h, q, e, mean, rstd, aq.tensor_amax_partials_ref(y)


def norm_output_ref(q, e, mean, rstd, weight, bias, zero_centered):
    """fp32 normalized output recomputed from the FP8 copy (what the GEMM input is quantized from)."""
    return _normalize_ref(aq.group_dequantize_ref(q, e, torch.float32), mean, rstd, weight, bias, zero_centered)


def norm_backward_ref(q, e, mean, rstd, weight, dy, dres, has_bias, zero_centered):
    xd = aq.group_dequantize_ref(q, e, torch.float32)
    w, _ = _gamma(weight, None, zero_centered)
    xhat = xd * rstd[:, None] if mean is None else (xd - mean[:, None]) * rstd[:, None]
    g = dy.float() * w
    h = xd.shape[-1]
    dx = g - xhat * ((g * xhat).sum(-1, keepdim=True) / h)
    if mean is not None:
        dx = dx - g.sum(-1, keepdim=True) / h
    dx = dx * rstd[:, None]
    if dres is not None:
        dx = dx + dres.float()
    dw = (dy.float() * xhat).sum(0)
    db = dy.float().sum(0) if has_bias else None
    return dx.to(dy.dtype), dw, db


# ------------------------------------------------------------------------------------------------ public ops
def _rows_per_program(bh):
    return max(1, min(16, 4096 // bh))


def _warps(bh):
    return 8 if bh >= 2048 else 4


def norm_forward(x2d, weight, bias=None, *, residual=None, kind="rmsnorm", eps=1e-5, zero_centered=False,
                 triton_kernels=None):
    """x2d [M, H] (+ residual) -> (h | None, q fp8 [M, H], e bf16 [M, H/16], mean | None, rstd, partial amax)."""
    if kind not in ("rmsnorm", "layernorm"):
        raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")
    is_rms = kind == "rmsnorm"
    m, h = x2d.shape
    aq.check_group_dim(h, "hidden size")
    if not (aq.use_triton(x2d) if triton_kernels is None else triton_kernels):
        return norm_forward_ref(x2d, weight, bias, residual, is_rms, eps, zero_centered)
    dev = x2d.device
    x2d = x2d.contiguous()
    hsum = torch.empty_like(x2d) if residual is not None else None
    q = torch.empty(m, h, dtype=E4M3.dtype, device=dev)
    e = torch.empty(m, h // aq.GROUP, dtype=aq.SCALE_DTYPE, device=dev)
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    bh = triton.next_power_of_2(h)
    bm = _rows_per_program(bh)
    grid = (triton.cdiv(m, bm),)
    partial = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=dev)
    if m:
        _norm_fwd_kernel[grid](x2d, residual.contiguous() if residual is not None else None, hsum, q, e, mean, rstd,
                               partial, weight, bias, m, h, eps, IS_RMS=is_rms, HAS_RES=residual is not None,
                               HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered, BM=bm, BH=bh,
                               num_warps=_warps(bh))
    return hsum, q, e, mean, rstd, partial


CAST_BM, CAST_BN, CAST_WARPS = 16, 256, 4  # best of the H100 sweep


def norm_cast(q, e, mean, rstd, weight, bias, scale, *, zero_centered=False, write_row=True, write_t=False,
              triton_kernels=None):
    """Per-tensor E4M3 of the normalized output, recomputed from the FP8 copy: (y8 [M, H] | None, y8_t | None)."""
    if not (aq.use_triton(q) if triton_kernels is None else triton_kernels):
        y = norm_output_ref(q, e, mean, rstd, weight, bias, zero_centered)
        return aq.cast_ref(y, scale, E4M3, write_row, write_t)
    m, h = q.shape
    mp = aq.pad16(m)
    out = torch.empty(m, h, dtype=E4M3.dtype, device=q.device) if write_row else None
    out_t = torch.empty(h, mp, dtype=E4M3.dtype, device=q.device) if write_t else None
    grid = (triton.cdiv(mp if write_t else m, CAST_BM), triton.cdiv(h, CAST_BN))
    _norm_cast_kernel[grid](q, e, mean, rstd, weight, bias, scale, out, out_t, m, h, mp, IS_RMS=mean is None,
                            HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered, WRITE_ROW=write_row,
                            WRITE_T=write_t, BM=CAST_BM, BN=CAST_BN, num_warps=CAST_WARPS)
    return out, out_t


BWD_ROWS = 32


def norm_backward(q, e, mean, rstd, weight, dy, *, dres=None, has_bias=False, zero_centered=False,
                  partial_amax=False, triton_kernels=None):
    """-> (dx [M, H] in dy's dtype (+ dres), dweight fp32 [H], dbias fp32 [H] | None[, partial amax of dx])."""
    if not (aq.use_triton(q) if triton_kernels is None else triton_kernels):
        out = norm_backward_ref(q, e, mean, rstd, weight, dy, dres, has_bias, zero_centered)
        return out + (aq.tensor_amax_partials_ref(out[0]),) if partial_amax else out
    m, h = q.shape
    bh = triton.next_power_of_2(h)
    rows = BWD_ROWS if m >= 64 * BWD_ROWS else max(1, min(BWD_ROWS, m // 4))
    grid = (triton.cdiv(m, rows),)
    dx = torch.empty(m, h, dtype=dy.dtype, device=q.device)
    alloc = torch.empty if m else torch.zeros  # every program writes its row of partials
    dw = alloc(max(grid[0], 1), h, dtype=torch.float32, device=q.device)
    db = alloc(max(grid[0], 1), h, dtype=torch.float32, device=q.device) if has_bias else None
    partial = alloc(max(grid[0], 1), dtype=torch.float32, device=q.device)
    if m:
        _norm_bwd_kernel[grid](q, e, mean, rstd, weight, dy.contiguous(),
                               dres.contiguous() if dres is not None else None, dx, dw, db, partial, m, h,
                               IS_RMS=mean is None, HAS_DRES=dres is not None, HAS_BIAS=has_bias,
                               WRITE_PARTIAL=partial_amax, ZERO_CENTERED=zero_centered, ROWS=rows, BH=bh, num_warps=_warps(bh))
    out = dx, dw.sum(0), (db.sum(0) if has_bias else None)
    return out + (partial,) if partial_amax else out
