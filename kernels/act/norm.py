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

from ..formats import E4M3, E5M2
from ..triton_fp8 import nanmax
from .group_quant import (SCALE_DTYPE, amax_partials_reference, group_dequantize_reference,
                          group_quantize_reference)
from .scaling import ScaleTickets, StageOneAmax, stage_two_args, store_partial
from .tensor_quant import cast_reference
from .tiles import (GROUP, cdiv, check_group_dim, group_tile, load_group_tile, next_power_of_2, pad16,
                    quantize_group_tile, store_cast_groups, tile_amax)


@triton.jit
def _normalize(xd, mean, rstd, w, b, mask, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """xd [G, BM, 16], mean/rstd [1, BM, 1], w/b [G, 1, 16]."""
    if IS_RMS:
        y = xd * rstd * w
    else:
        y = (xd - mean) * rstd * w
    if HAS_BIAS:
        y = y + b
    return tl.where(mask, y, 0.0)


@triton.jit
def _load_gamma(w_ptr, b_ptr, g0, H, G: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """gamma (and beta) of groups g0.. as fp32 [G, 1, 16]."""
    cols = g0 * 16 + tl.arange(0, G)[:, None, None] * 16 + tl.arange(0, 16)[None, None, :]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    b = w
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _row_stat(ptr, rows, M):
    return tl.load(ptr + rows, mask=rows < M, other=0.0)[None, :, None]


@triton.jit
def _norm_fwd_kernel(x_ptr, res_ptr, h_ptr, q_ptr, e_ptr, mean_ptr, rstd_ptr, partial_ptr, w_ptr, b_ptr,
                     M, H, eps, IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, BM: tl.constexpr, G: tl.constexpr,
                     ticket_ptr, scale_ptr, NP, FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    pid = tl.program_id(0)
    rows = (pid * BM + tl.arange(0, BM)).to(tl.int64)
    offs, eoffs, mask = group_tile(rows, 0, M, H, H // 16, G)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, h, mask=mask)
        x = h.to(tl.float32)
    q, e, xd = quantize_group_tile(x, 448.0, False)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(e_ptr + eoffs, e.to(tl.bfloat16), mask=mask)
    if IS_RMS:
        mean = tl.zeros((1, BM, 1), tl.float32)
        var = tl.sum(tl.sum(xd * xd, axis=2, keep_dims=True), axis=0, keep_dims=True) / H
    else:
        mean = tl.sum(tl.sum(xd, axis=2, keep_dims=True), axis=0, keep_dims=True) / H
        xc = tl.where(mask, xd - mean, 0.0)
        var = tl.sum(tl.sum(xc * xc, axis=2, keep_dims=True), axis=0, keep_dims=True) / H
        tl.store(mean_ptr + rows[None, :, None], mean, mask=rows[None, :, None] < M)
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(rstd_ptr + rows[None, :, None], rstd, mask=rows[None, :, None] < M)
    w, b = _load_gamma(w_ptr, b_ptr, 0, H, G, HAS_BIAS, ZERO_CENTERED)
    y = _normalize(xd, mean, rstd, w, b, mask, IS_RMS, HAS_BIAS)
    store_partial(partial_ptr, pid, tile_amax(y, mask), NP, ticket_ptr, scale_ptr, FP8_MAX, FINAL)


@triton.jit
def _norm_cast_kernel(q_ptr, e_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, scale_ptr, out_ptr, out_t_ptr, M, H, M_PAD,
                      IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                      WRITE_ROW: tl.constexpr, WRITE_T: tl.constexpr, BM: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)  # flat grid, group blocks fastest
    n_g = tl.cdiv(H // 16, G)
    g0 = (pid % n_g) * G
    rows = ((pid // n_g) * BM + tl.arange(0, BM)).to(tl.int64)
    offs, eoffs, mask = group_tile(rows, g0, M, H, H // 16, G)
    xd = load_group_tile(q_ptr, e_ptr, offs, eoffs, mask)
    rstd = _row_stat(rstd_ptr, rows, M)
    if IS_RMS:
        mean = rstd
    else:
        mean = _row_stat(mean_ptr, rows, M)
    w, b = _load_gamma(w_ptr, b_ptr, g0, H, G, HAS_BIAS, ZERO_CENTERED)
    y = _normalize(xd, mean, rstd, w, b, mask, IS_RMS, HAS_BIAS)
    store_cast_groups(y, rows, g0, tl.load(scale_ptr), out_ptr, out_t_ptr, M, H, M_PAD, G, WRITE_ROW, WRITE_T, False,
                      False)


@triton.jit
def _norm_bwd_kernel(q_ptr, e_ptr, mean_ptr, rstd_ptr, w_ptr, dy_ptr, dres_ptr, dx_ptr, dw_ptr, db_ptr, partial_ptr,
                     M, H, IS_RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr,
                     WRITE_PARTIAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, ROWS: tl.constexpr, G: tl.constexpr,
                     NUM_STAGES: tl.constexpr, ticket_ptr, scale_ptr, NP, FP8_MAX: tl.constexpr, FINAL: tl.constexpr):
    """ROWS rows per program, one per iteration (the loop software-pipelined: the next row's loads are in flight
    during this row's math); dw (db) summed over them into one fp32 row of partials. 2-D [G, 16] row tiles with
    scalar row offsets keep the address math per 16 elements, not per element."""
    pid = tl.program_id(0)
    cols = tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :]
    gmask = tl.arange(0, G)[:, None] < H // 16
    w = tl.load(w_ptr + cols, mask=gmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw = tl.zeros((G, 16), tl.float32)
    db = tl.zeros((G, 16), tl.float32)
    amax = tl.zeros((G, 16), tl.float32)
    for r in tl.range(ROWS, num_stages=NUM_STAGES):
        row = pid * ROWS + r
        mask = gmask & (row < M)
        base = row.to(tl.int64) * H
        q = tl.load(q_ptr + base + cols, mask=mask, other=0.0)
        e = tl.load(e_ptr + row.to(tl.int64) * (H // 16) + tl.arange(0, G)[:, None], mask=mask, other=1.0)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DRES:
            dres = tl.load(dres_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
        xd = q.to(tl.float32) * e.to(tl.float32)
        g = dy * w
        if IS_RMS:
            xhat = xd * rstd
            dx = (g - xhat * (tl.sum(tl.sum(g * xhat, axis=1), axis=0) / H)) * rstd
        else:
            xhat = tl.where(mask, (xd - tl.load(mean_ptr + row, mask=row < M, other=0.0)) * rstd, 0.0)
            c1 = tl.sum(tl.sum(g, axis=1), axis=0) / H
            c2 = tl.sum(tl.sum(g * xhat, axis=1), axis=0) / H
            dx = (g - c1 - xhat * c2) * rstd
        if HAS_DRES:
            dx = dx + dres
        dx = dx.to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + base + cols, dx, mask=mask)
        if WRITE_PARTIAL:  # stage 1 of the E5M2 quantization of dx by the next GEMM's backward (masked lanes: 0)
            amax = nanmax(amax, tl.abs(dx.to(tl.float32)))
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(dw_ptr + pid.to(tl.int64) * H + cols, dw, mask=gmask)
    if HAS_BIAS:
        tl.store(db_ptr + pid.to(tl.int64) * H + cols, db, mask=gmask)
    if WRITE_PARTIAL:
        m = tl.reduce(amax, None, nanmax)
        store_partial(partial_ptr, pid, tl.where(m == float("inf"), float("nan"), m), NP, ticket_ptr, scale_ptr,
                         FP8_MAX, FINAL)


# ------------------------------------------------------------------------------------------- torch references
def _gamma(weight, bias, zero_centered):
    w = weight.float() + 1.0 if zero_centered else weight.float()
    return w, (bias.float() if bias is not None else None)


def _stats_reference(xd, is_rms, eps):
    if is_rms:
        return None, 1.0 / torch.sqrt((xd * xd).mean(-1) + eps)
    mean = xd.mean(-1)
    return mean, 1.0 / torch.sqrt(((xd - mean[:, None]) ** 2).mean(-1) + eps)


def _normalize_reference(xd, mean, rstd, weight, bias, zero_centered):
    w, b = _gamma(weight, bias, zero_centered)
    xhat = xd * rstd[:, None] if mean is None else (xd - mean[:, None]) * rstd[:, None]
    y = xhat * w
    return y + b if b is not None else y


def norm_forward_reference(x, weight, bias, residual, is_rms, eps, zero_centered):
    h = (x + residual) if residual is not None else None
    q, e = group_quantize_reference(h if h is not None else x, E4M3)
    xd = group_dequantize_reference(q, e, torch.float32)
    mean, rstd = _stats_reference(xd, is_rms, eps)
    y = _normalize_reference(xd, mean, rstd, weight, bias, zero_centered)
    return h, q, e, mean, rstd, amax_partials_reference(y)


def norm_output_reference(q, e, mean, rstd, weight, bias, zero_centered):
    """fp32 normalized output recomputed from the FP8 copy (what the GEMM input is quantized from)."""
    x = group_dequantize_reference(q, e, torch.float32)
    return _normalize_reference(x, mean, rstd, weight, bias, zero_centered)


def norm_backward_reference(q, e, mean, rstd, weight, dy, dres, has_bias, zero_centered):
    xd = group_dequantize_reference(q, e, torch.float32)
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


def _warps(bh):  # one 1x16 group per thread for H >= 512 (H = 4096: 8 warps)
    return max(1, min(8, bh // 512))


def norm_forward(x2d, weight, bias, use_triton: bool, *, residual=None, kind="rmsnorm", eps=1e-5,
                 zero_centered=False, tickets: ScaleTickets | None = None):
    """x2d [M, H] (+ residual) -> (h | None, codes fp8 [M, H], scales bf16 [M, H/16], mean | None, rstd,
    StageOneAmax of the normalized output with its E4M3 scale)."""
    if kind not in ("rmsnorm", "layernorm"):
        raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {kind!r}")
    is_rms = kind == "rmsnorm"
    m, h = x2d.shape
    check_group_dim(h, "hidden size")
    if not use_triton:
        hsum, q, e, mean, rstd, partials = norm_forward_reference(x2d, weight, bias, residual, is_rms, eps,
                                                                  zero_centered)
        return hsum, q, e, mean, rstd, StageOneAmax(partials)
    dev = x2d.device
    x2d = x2d.contiguous()
    # x + residual in their promoted dtype, as torch adds them (BF16 blocks on an fp32 residual stream keep it fp32)
    hsum = torch.empty(m, h, dtype=torch.promote_types(x2d.dtype, residual.dtype), device=dev) \
        if residual is not None else None
    q = torch.empty(m, h, dtype=E4M3.dtype, device=dev)
    e = torch.empty(m, h // GROUP, dtype=SCALE_DTYPE, device=dev)
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=dev)
    rstd = torch.empty(m, dtype=torch.float32, device=dev)
    bh = next_power_of_2(h)
    bm = _rows_per_program(bh)
    grid = (cdiv(m, bm),)
    partials = (torch.empty if m else torch.zeros)(max(grid[0], 1), dtype=torch.float32, device=dev)
    kwargs, amax = stage_two_args(partials, E4M3, tickets)
    if m:
        _norm_fwd_kernel[grid](x2d, residual.contiguous() if residual is not None else None, hsum, q, e, mean, rstd,
                               partials, weight, bias, m, h, eps, IS_RMS=is_rms, HAS_RES=residual is not None,
                               HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered, BM=bm, G=bh // GROUP,
                               num_warps=_warps(bh), **kwargs)
    else:
        amax = StageOneAmax(partials)
    return hsum, q, e, mean, rstd, amax


# (rows, groups, warps) per program, one 1x16 group per thread; transposed output: taller tiles (32-byte runs)
ROW_TILE, T_TILE = (16, 16, 8), (32, 8, 8)


def norm_cast(q, e, mean, rstd, weight, bias, scale, use_triton: bool, *, zero_centered=False, write_row=True,
              write_t=False):
    """Per-tensor E4M3 of the normalized output, recomputed from the FP8 copy: (y8 [M, H] | None, y8_t | None)."""
    if not use_triton:
        y = norm_output_reference(q, e, mean, rstd, weight, bias, zero_centered)
        return cast_reference(y, scale, E4M3, write_row, write_t)
    if write_row and write_t:  # one launch writing both gave wrong transposed codes on the H100: two launches
        kw = dict(zero_centered=zero_centered)
        return (norm_cast(q, e, mean, rstd, weight, bias, scale, True, **kw)[0],
                norm_cast(q, e, mean, rstd, weight, bias, scale, True, write_row=False, write_t=True, **kw)[1])
    m, h = q.shape
    mp = pad16(m)
    out = torch.empty(m, h, dtype=E4M3.dtype, device=q.device) if write_row else None
    out_t = torch.empty(h, mp, dtype=E4M3.dtype, device=q.device) if write_t else None
    bm, g, w = T_TILE if write_t else ROW_TILE
    grid = (cdiv(mp if write_t else m, bm) * cdiv(h // GROUP, g),)
    if grid[0]:
        _norm_cast_kernel[grid](q, e, mean, rstd, weight, bias, scale, out, out_t, m, h, mp, IS_RMS=mean is None,
                                HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered, WRITE_ROW=write_row,
                                WRITE_T=write_t, BM=bm, G=g, num_warps=w)
    return out, out_t


# rows per program (8192 rows -> 256 programs), warps for H >= 4096, software-pipelining depth of the row loop
# (the best of a tile sweep; RESULTS_activations.md)
BWD_ROWS, BWD_WARPS, BWD_STAGES = 32, 4, 3


def norm_backward(q, e, mean, rstd, weight, dy, use_triton: bool, *, dres=None, has_bias=False, zero_centered=False,
                  partial_amax=False, tickets: ScaleTickets | None = None):
    """-> (dx [M, H] in dy's dtype (+ dres), dweight fp32 [H], dbias fp32 [H] | None[, StageOneAmax of dx with its
    E5M2 scale])."""
    if not use_triton:
        out = norm_backward_reference(q, e, mean, rstd, weight, dy, dres, has_bias, zero_centered)
        return out + (StageOneAmax(amax_partials_reference(out[0])),) if partial_amax else out
    m, h = q.shape
    bh = next_power_of_2(h)
    rows = BWD_ROWS if m >= 64 * BWD_ROWS else max(1, min(BWD_ROWS, m // 4))
    grid = (cdiv(m, rows),)
    dx = torch.empty(m, h, dtype=dy.dtype, device=q.device)
    alloc = torch.empty if m else torch.zeros  # every program writes its row of partials
    dw = alloc(max(grid[0], 1), h, dtype=torch.float32, device=q.device)
    db = alloc(max(grid[0], 1), h, dtype=torch.float32, device=q.device) if has_bias else None
    partials = alloc(max(grid[0], 1), dtype=torch.float32, device=q.device)
    kwargs, amax = stage_two_args(partials, E5M2 if partial_amax and m else None, tickets)
    if m:
        _norm_bwd_kernel[grid](q, e, mean, rstd, weight, dy.contiguous(),
                               dres.contiguous() if dres is not None else None, dx, dw, db, partials, m, h,
                               IS_RMS=mean is None, HAS_DRES=dres is not None, HAS_BIAS=has_bias,
                               WRITE_PARTIAL=partial_amax, ZERO_CENTERED=zero_centered, ROWS=rows, G=bh // GROUP,
                               NUM_STAGES=BWD_STAGES, num_warps=BWD_WARPS if bh >= 4096 else _warps(bh), **kwargs)
    out = dx, dw.sum(0), (db.sum(0) if has_bias else None)
    return out + (amax,) if partial_amax else out
