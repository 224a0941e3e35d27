"""Triton kernels: FP8 group quantization with Dynamic Range Expansion, and the fused multi-tensor AdamW step.

Same math and operation order as `dre_reference.py` (IEEE div/sqrt, portable_math's log2/exp2/fma, no other FMA
contraction), so codes match the reference bit for bit on the GPU and under TRITON_INTERPRET.

The fused AdamW step works on rows of GROUPS_PER_PROGRAM groups (`GroupLayout.rows`) of many tensors at once,
through a pointer table, with no host synchronisation. Its body (`_adamw_tile`) is shared by two entry points that
differ only in how a row's elements are spread over threads: on CUDA a Gluon kernel with an explicit layout
(THREADS_PER_GROUP threads per group, 4 contiguous elements per load), so each thread computes its group's
metadata once per 8 elements instead of once per 4 as Triton's own layout does; under TRITON_INTERPRET (which
cannot run Gluon) the Triton kernel. Rows whose groups are all full take an unmasked, vectorized path.
Measured alternatives are in BENCHMARKS.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import get_format
from ..portable_math import exp2_p, fma_p, log2_p
from ..triton_fp8 import INTERPRET, nanmax, to_e4m3, to_e5m2
from .config import triton_supports_group_size
from .dre_reference import LOG2_RATIO_EPS, AdamWScalars, DREConfig, f32
from .grouping import GroupLayout

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # older Triton: the Triton kernel runs on CUDA too
    gluon = None

GROUPS_PER_PROGRAM = 4  # fused AdamW: groups per row (one program), at least (see launch_shape)
NUM_WARPS = 2
THREADS_PER_GROUP = 16  # Gluon layout: 16 threads x 2 loads of 4 elements per group of 128
MAX_REGISTERS = 64  # per thread (ptxas maxnreg): 16 CTAs per SM instead of 10 at the compiler's 95 (measured faster)
TILE_GROUPS = 8  # standalone quantize/dequantize: groups per program
TABLE_COLUMNS: tl.constexpr = tl.constexpr(9)  # fused AdamW pointer table: see FusedAdamW._pointer_table
LOG2_RATIO_EPS_C: tl.constexpr = tl.constexpr(LOG2_RATIO_EPS)
MIN_NORMAL: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # 2^-126: smaller magnitudes count as zero


@triton.jit
def _group_params(big, small, EXPAND: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr):
    """See dre_reference.group_params: (k, log2 center, log2(scale * Q)) per group."""
    nonzero = big >= MIN_NORMAL
    log2_big = log2_p(tl.where(nonzero, big, 1.0))
    log2_small = log2_p(tl.where(nonzero, small, 1.0))
    if EXPAND:
        log2_ratio = log2_big - log2_small
        k = tl.floor(tl.math.div_rn(tl.where(nonzero, NUM, NUM), log2_ratio)) * INV_EMIN
        k = tl.where(log2_ratio <= LOG2_RATIO_EPS_C, 1.0, tl.minimum(tl.maximum(k, INV_EMIN), KMAX))
        log2_center = (log2_big + log2_small) * 0.5
    else:  # tl.where instead of tl.full: Gluon's full needs a layout
        k = tl.where(nonzero, 1.0, 1.0)
        log2_center = tl.where(nonzero, 0.0, 0.0)
    return k, log2_center, k * (log2_big - log2_center)


@triton.jit
def _encode(x, k, log2_center, log2_scale_q, E5M2: tl.constexpr, LOG2_MAX: tl.constexpr,
            KEEP_NONZERO: tl.constexpr, MIN_SUB: tl.constexpr, SIGNED: tl.constexpr = True):
    """FP8 codes of x given its group's metadata (broadcastable to x's shape); see dre_reference.encode."""
    offset = log2_scale_q - LOG2_MAX + k * log2_center
    y = exp2_p(fma_p(k, log2_p(tl.abs(x), True), -offset), True)
    if KEEP_NONZERO:
        y = tl.where(tl.abs(x) >= MIN_NORMAL, tl.maximum(y, MIN_SUB), y)
    if SIGNED:
        y = tl.where(x < 0, -y, y)
    if E5M2:
        return to_e5m2(y)
    else:
        return to_e4m3(y)


@triton.jit
def _decode(raw, log2_table, inv_k, bias, SIGNED: tl.constexpr = True):
    """fp32 values of uint8 codes, given per-group 1/k and bias (broadcast); see dre_reference.decode."""
    xa = exp2_p(fma_p(tl.load(log2_table + raw), inv_k, bias))
    if SIGNED:
        xa = tl.where(raw >= 128, -xa, xa)
    return xa


@triton.jit
def _join_master(hi16, lo16):
    """fp32 masters of bf16 parameter bits and their remainders (uint16); see master_remainders.join."""
    hi = hi16.to(tl.uint32)
    lo = lo16.to(tl.uint32)
    borrow = (lo >= 32768) & ((hi & 32767) != 32767)
    return (((hi - borrow.to(tl.uint32)) << 16) | lo).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(x):
    """(bf16 parameter bits, remainder) as uint16 of fp32 masters; see master_remainders.split."""
    b = x.to(tl.uint32, bitcast=True)
    hi = b >> 16
    lo = b & 65535
    carry = (lo >= 32768) & ((hi & 32767) != 32767)
    return (hi + carry.to(tl.uint32)).to(tl.uint16), lo.to(tl.uint16)


@triton.jit
def _ptr(table, col: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(table + col).to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _load_meta(meta, n_groups, gid, gmask):
    k = tl.load(meta + gid, mask=gmask, other=1.0)
    log2_center = tl.load(meta + n_groups + gid, mask=gmask, other=0.0)
    log2_scale_q = tl.load(meta + 2 * n_groups + gid, mask=gmask, other=0.0)
    return k, log2_center, log2_scale_q


@triton.jit
def _store_meta(meta, n_groups, gid, gmask, k, log2_center, log2_scale_q):
    tl.store(meta + gid, k, mask=gmask)
    tl.store(meta + n_groups + gid, log2_center, mask=gmask)
    tl.store(meta + 2 * n_groups + gid, log2_scale_q, mask=gmask)


@triton.jit
def _row_tile(row, GROUP: tl.constexpr, NG: tl.constexpr):
    """Element offsets [NG, GROUP] and group ids [NG] of one row (flat_start, numel, first_group), with masks."""
    start = tl.load(row)
    numel = tl.load(row + 1).to(tl.int32)
    first_group = tl.load(row + 2)
    local = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    gid = first_group + tl.arange(0, NG)
    return start, local, local < numel, gid, tl.arange(0, NG) * GROUP < numel


@triton.jit
def _decode_group_tile(raw, meta, n_groups, gid, gmask, log2_table, LOG2_MAX: tl.constexpr,
                       SIGNED: tl.constexpr = True):
    """Codes [NG, GROUP] of groups `gid` -> fp32 values."""
    k, log2_center, log2_scale_q = _load_meta(meta, n_groups, gid, gmask)
    inv_k = tl.math.div_rn(tl.where(gmask, 1.0, 1.0), k)
    bias = (log2_scale_q - LOG2_MAX) * inv_k + log2_center
    return _decode(raw, log2_table, inv_k[:, None], bias[:, None], SIGNED)


@triton.jit
def _encode_group_tile(x, ax, big, mask, codes_ptrs, meta, n_groups, gid, gmask, E5M2: tl.constexpr,
                       EXPAND: tl.constexpr, LOG2_MAX: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr,
                       KMAX: tl.constexpr, KEEP_NONZERO: tl.constexpr, MIN_SUB: tl.constexpr,
                       SIGNED: tl.constexpr = True):
    """Quantize fp32 x [NG, GROUP] groupwise, given ax = |x| (0 where masked) and big = its row max: store codes
    where `mask` and the metadata where `gmask`."""
    # min |x| >= 2^-126 over unsigned bit patterns: zero and subnormals wrap above every normal (cheaper than a
    # where; groups with no normal value never use it)
    key = ax.to(tl.uint32, bitcast=True) - 0x00800000
    small = (tl.min(key, axis=1) + 0x00800000).to(tl.float32, bitcast=True)
    k, log2_center, log2_scale_q = _group_params(big, small, EXPAND, NUM, INV_EMIN, KMAX)
    codes = _encode(x, k[:, None], log2_center[:, None], log2_scale_q[:, None], E5M2, LOG2_MAX, KEEP_NONZERO,
                    MIN_SUB, SIGNED)
    tl.store(codes_ptrs, codes.to(tl.uint8, bitcast=True), mask=mask)
    _store_meta(meta, n_groups, gid, gmask, k, log2_center, log2_scale_q)


@triton.jit
def _quantize_tile(x, mask, codes_ptrs, meta, n_groups, gid, gmask, E5M2: tl.constexpr, EXPAND: tl.constexpr,
                   LOG2_MAX: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr,
                   KEEP_NONZERO: tl.constexpr, MIN_SUB: tl.constexpr):
    ax = tl.where(mask, tl.abs(x), 0.0)
    _encode_group_tile(x, ax, tl.max(ax, axis=1), mask, codes_ptrs, meta, n_groups, gid, gmask, E5M2, EXPAND,
                       LOG2_MAX, NUM, INV_EMIN, KMAX, KEEP_NONZERO, MIN_SUB)


@triton.jit
def _adamw_tile(
    row, tensors, scalars, skipped, m_table, v_table, local, groups,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    M_E5M2: tl.constexpr, M_EXPAND: tl.constexpr, M_LOG2_MAX: tl.constexpr, M_NUM: tl.constexpr,
    M_INV_EMIN: tl.constexpr, M_KMAX: tl.constexpr,
    M_KEEP_NONZERO: tl.constexpr, M_MIN_SUB: tl.constexpr,
    V_E5M2: tl.constexpr, V_EXPAND: tl.constexpr, V_LOG2_MAX: tl.constexpr, V_NUM: tl.constexpr,
    V_INV_EMIN: tl.constexpr, V_KMAX: tl.constexpr,
    V_KEEP_NONZERO: tl.constexpr, V_MIN_SUB: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, ALIGNED: tl.constexpr, FULL: tl.constexpr,
    REMAINDER: tl.constexpr,
):
    """One row (tensor, flat_start, numel, first_group): dequantize m and v, AdamW, re-quantize; see
    dre_reference.fused_adamw_step. FULL: the row's groups are all complete, so loads and stores need no element
    mask and vectorize (a separate launch: a branch inside the kernel measured slower). REMAINDER: the params are
    bf16 with master remainders (table column 8), stepped as their fp32 masters."""
    t = tl.load(row)
    start = tl.load(row + 1)
    numel = tl.load(row + 2).to(tl.int32)
    first_group = tl.load(row + 3)
    if FULL:
        mask = local < NG * GROUP  # all true: folded away
    else:
        mask = local < numel
    gid = first_group + groups
    gmask = groups * GROUP < numel
    if ALIGNED:
        start = tl.multiple_of(start, 16)
    tab = tensors + t * TABLE_COLUMNS
    if REMAINDER:
        p_ptr = _ptr(tab, 0, tl.uint16, ALIGNED) + start
        r_ptr = _ptr(tab, 8, tl.uint16, ALIGNED) + start
    else:
        p_ptr = _ptr(tab, 0, P_DTYPE, ALIGNED) + start
    g_ptr = _ptr(tab, 1, G_DTYPE, ALIGNED) + start
    mq_ptr = _ptr(tab, 2, tl.uint8, ALIGNED) + start
    vq_ptr = _ptr(tab, 3, tl.uint8, ALIGNED) + start
    m_meta = _ptr(tab, 4, tl.float32, False)
    v_meta = _ptr(tab, 5, tl.float32, False)
    n_groups = tl.load(tab + 6)
    sc = scalars + tl.load(tab + 7) * 8  # AdamWScalars, in field order
    decay = tl.load(sc)
    step_size = tl.load(sc + 1)
    inv_bc2_sqrt = tl.load(sc + 2)
    eps = tl.load(sc + 3)
    beta1 = tl.load(sc + 4)
    one_minus_beta1 = tl.load(sc + 5)
    beta2 = tl.load(sc + 6)
    one_minus_beta2 = tl.load(sc + 7)

    if REMAINDER:
        p = _join_master(tl.load(p_ptr + local, mask=mask, other=0), tl.load(r_ptr + local, mask=mask, other=0))
    else:
        p = tl.load(p_ptr + local, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + local, mask=mask, other=0.0).to(tl.float32)
    m = _decode_group_tile(tl.load(mq_ptr + local, mask=mask, other=0), m_meta, n_groups, gid, gmask, m_table,
                           M_LOG2_MAX)
    v = _decode_group_tile(tl.load(vq_ptr + local, mask=mask, other=0), v_meta, n_groups, gid, gmask, v_table,
                           V_LOG2_MAX, False)  # v >= 0: no sign to decode or encode
    m = fma_p(m, beta1, g * one_minus_beta1)
    v = fma_p(v, beta2, (g * g) * one_minus_beta2)
    denom = fma_p(tl.math.sqrt_rn(v), inv_bc2_sqrt, eps)
    p = fma_p(-step_size, tl.math.div_rn(m, denom), p * decay)

    m_abs = tl.where(mask, tl.abs(m), 0.0)
    v_abs = tl.where(mask, v, 0.0)
    v_big = tl.reduce(v_abs, 1, nanmax)
    if SKIP_NONFINITE:  # groups whose new v is NaN/Inf keep everything
        bad = ~(v_big < float("inf"))
        n_bad = tl.sum(bad.to(tl.int32), axis=0)
        tl.atomic_add(skipped, n_bad, mask=n_bad > 0)
        gmask = gmask & ~bad
        mask = mask & ~bad[:, None]
    if REMAINDER:
        p_bits, r_bits = _split_master(p)
        tl.store(p_ptr + local, p_bits, mask=mask)
        tl.store(r_ptr + local, r_bits, mask=mask)
    else:
        tl.store(p_ptr + local, p.to(P_DTYPE), mask=mask)
    _encode_group_tile(m, m_abs, tl.max(m_abs, axis=1), mask, mq_ptr + local, m_meta, n_groups, gid, gmask,
                       M_E5M2, M_EXPAND, M_LOG2_MAX, M_NUM, M_INV_EMIN, M_KMAX, M_KEEP_NONZERO, M_MIN_SUB)
    _encode_group_tile(v, v_abs, v_big, mask, vq_ptr + local, v_meta, n_groups, gid, gmask, V_E5M2, V_EXPAND,
                       V_LOG2_MAX, V_NUM, V_INV_EMIN, V_KMAX, V_KEEP_NONZERO, V_MIN_SUB, False)


@triton.jit
def _fused_adamw_kernel(
    rows, tensors, scalars, skipped, m_table, v_table,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    M_E5M2: tl.constexpr, M_EXPAND: tl.constexpr, M_LOG2_MAX: tl.constexpr, M_NUM: tl.constexpr,
    M_INV_EMIN: tl.constexpr, M_KMAX: tl.constexpr,
    M_KEEP_NONZERO: tl.constexpr, M_MIN_SUB: tl.constexpr,
    V_E5M2: tl.constexpr, V_EXPAND: tl.constexpr, V_LOG2_MAX: tl.constexpr, V_NUM: tl.constexpr,
    V_INV_EMIN: tl.constexpr, V_KMAX: tl.constexpr,
    V_KEEP_NONZERO: tl.constexpr, V_MIN_SUB: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, ALIGNED: tl.constexpr, FULL: tl.constexpr,
    THREADS_PER_GROUP: tl.constexpr, REMAINDER: tl.constexpr,
):
    groups = tl.arange(0, NG)
    local = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    _adamw_tile(rows + tl.program_id(0) * 4, tensors, scalars, skipped, m_table, v_table, local, groups,
                P_DTYPE, G_DTYPE, M_E5M2, M_EXPAND, M_LOG2_MAX, M_NUM, M_INV_EMIN, M_KMAX, M_KEEP_NONZERO,
                M_MIN_SUB, V_E5M2, V_EXPAND, V_LOG2_MAX, V_NUM, V_INV_EMIN, V_KMAX, V_KEEP_NONZERO, V_MIN_SUB,
                SKIP_NONFINITE, GROUP, NG, ALIGNED, FULL, REMAINDER)


if gluon is not None:
    @gluon.jit
    def _fused_adamw_gluon(
        rows, tensors, scalars, skipped, m_table, v_table,
        P_DTYPE: gl.constexpr, G_DTYPE: gl.constexpr,
        M_E5M2: gl.constexpr, M_EXPAND: gl.constexpr, M_LOG2_MAX: gl.constexpr, M_NUM: gl.constexpr,
        M_INV_EMIN: gl.constexpr, M_KMAX: gl.constexpr,
        M_KEEP_NONZERO: gl.constexpr, M_MIN_SUB: gl.constexpr,
        V_E5M2: gl.constexpr, V_EXPAND: gl.constexpr, V_LOG2_MAX: gl.constexpr, V_NUM: gl.constexpr,
        V_INV_EMIN: gl.constexpr, V_KMAX: gl.constexpr,
        V_KEEP_NONZERO: gl.constexpr, V_MIN_SUB: gl.constexpr,
        SKIP_NONFINITE: gl.constexpr, GROUP: gl.constexpr, NG: gl.constexpr, ALIGNED: gl.constexpr,
        FULL: gl.constexpr, THREADS_PER_GROUP: gl.constexpr, REMAINDER: gl.constexpr,
    ):
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // THREADS_PER_GROUP, THREADS_PER_GROUP],
                                                [gl.num_warps(), 1], [1, 0])
        groups = gl.arange(0, NG, layout=gl.SliceLayout(1, layout))
        local = groups[:, None] * GROUP + gl.arange(0, GROUP, layout=gl.SliceLayout(0, layout))[None, :]
        _adamw_tile(rows + gl.program_id(0) * 4, tensors, scalars, skipped, m_table, v_table, local, groups,
                    P_DTYPE, G_DTYPE, M_E5M2, M_EXPAND, M_LOG2_MAX, M_NUM, M_INV_EMIN, M_KMAX, M_KEEP_NONZERO,
                    M_MIN_SUB, V_E5M2, V_EXPAND, V_LOG2_MAX, V_NUM, V_INV_EMIN, V_KMAX, V_KEEP_NONZERO, V_MIN_SUB,
                    SKIP_NONFINITE, GROUP, NG, ALIGNED, FULL, REMAINDER)


def fused_adamw_kernel():
    """The entry point used for launches: Gluon on CUDA when available, else the Triton kernel."""
    return _fused_adamw_kernel if gluon is None or INTERPRET else _fused_adamw_gluon


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, meta, rows, n_groups, E5M2: tl.constexpr, EXPAND: tl.constexpr,
                     LOG2_MAX: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr,
                     KEEP_NONZERO: tl.constexpr, MIN_SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    x = tl.load(x_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    _quantize_tile(x, mask, codes_ptr + start + local, meta, n_groups, gid, gmask, E5M2, EXPAND, LOG2_MAX,
                   NUM, INV_EMIN, KMAX, KEEP_NONZERO, MIN_SUB)


@triton.jit
def _dequantize_kernel(codes_ptr, meta, out_ptr, rows, n_groups, log2_table, LOG2_MAX: tl.constexpr,
                       GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    raw = tl.load(codes_ptr + start + local, mask=mask, other=0)
    x = _decode_group_tile(raw, meta, n_groups, gid, gmask, log2_table, LOG2_MAX)
    tl.store(out_ptr + start + local, x, mask=mask)


def _moment_args(cfg: DREConfig):
    return dict(E5M2=cfg.fmt.name == "e5m2", EXPAND=cfg.expand, LOG2_MAX=cfg.log2_max, NUM=cfg.expand_numerator,
                INV_EMIN=cfg.inv_expand_min, KMAX=f32(cfg.k_max), KEEP_NONZERO=cfg.keep_nonzero,
                MIN_SUB=cfg.fmt.min_subnormal)


def quantize(x: torch.Tensor, layout: GroupLayout, cfg: DREConfig, rows: torch.Tensor | None = None):
    """Triton twin of `dre_reference.quantize`. rows: the layout's `rows(TILE_GROUPS)` on x's device (made here when
    not given, a blocking copy to the device: callers that repeat a layout keep them)."""
    codes = torch.zeros(layout.numel, dtype=cfg.fmt.dtype, device=x.device)
    meta = torch.empty(3, layout.num_groups, dtype=torch.float32, device=x.device)
    if rows is None:
        rows = layout.rows(TILE_GROUPS).to(x.device)
    if len(rows):
        _quantize_kernel[(len(rows),)](x.contiguous().view(-1), codes.view(torch.uint8), meta, rows,
                                       layout.num_groups, GROUP=layout.group_size, NG=TILE_GROUPS,
                                       enable_fp_fusion=False, **_moment_args(cfg))
    return codes, meta


def dequantize(codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout,
               rows: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `dre_reference.dequantize`; rows as for `quantize`."""
    out = torch.zeros(layout.numel, dtype=torch.float32, device=codes.device)
    if rows is None:
        rows = layout.rows(TILE_GROUPS).to(codes.device)
    fmt = get_format(codes.dtype)
    if len(rows):
        _dequantize_kernel[(len(rows),)](codes.view(torch.uint8), meta, out, rows, layout.num_groups,
                                         fmt.log2_table(codes.device), LOG2_MAX=fmt.log2_max,
                                         GROUP=layout.group_size, NG=TILE_GROUPS, enable_fp_fusion=False)
    return out


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def supports_group_size(group_size: int) -> bool:
    return triton_supports_group_size(group_size)


def launch_shape(group_size: int) -> tuple[int, int]:
    """(groups per row, threads per group) of the fused AdamW kernel: a row fills at least the CTA's threads."""
    if not supports_group_size(group_size):
        raise ValueError(f"the Triton kernels need a power-of-two group_size >= 4, got {group_size}")
    threads_per_group = min(THREADS_PER_GROUP, group_size // 4)
    return max(GROUPS_PER_PROGRAM, 32 // threads_per_group * NUM_WARPS), threads_per_group


def rows_for(layouts: list[GroupLayout], groups_per_row: int) -> torch.Tensor:
    """Rows of a multi-tensor launch, int64 [R, 4]: (tensor index, flat_start, numel, first_group)."""
    parts = []
    for i, layout in enumerate(layouts):
        r = layout.rows(groups_per_row)
        parts.append(torch.cat([torch.full((len(r), 1), i, dtype=torch.int64), r], dim=1))
    return torch.cat(parts) if parts else torch.zeros(0, 4, dtype=torch.int64)


class FusedAdamW:
    """The fused AdamW step over a fixed list of tensor layouts (one group size): rows built once, full rows and
    ragged ones launched separately, the pointer table kept on the device until a pointer changes. A call
    enqueues one or two kernels and no host synchronisation."""

    def __init__(self, layouts: list[GroupLayout], device: torch.device):
        group_size = layouts[0].group_size
        if any(lay.group_size != group_size for lay in layouts):
            raise ValueError("one FusedAdamW launch needs one group_size")
        self.group_size = group_size
        self.groups_per_row, self.threads_per_group = launch_shape(group_size)
        rows = rows_for(layouts, self.groups_per_row)
        full = rows[:, 2] == self.groups_per_row * group_size
        self.rows_aligned = bool((rows[:, 1] % 16 == 0).all())
        self.full_rows, self.ragged_rows = rows[full].to(device), rows[~full].to(device)
        self.layouts, self.device = layouts, device
        self._table_key, self._table, self._aligned = None, None, False

    def _pointer_table(self, columns, scalar_index, remainders):
        """int64 [n, TABLE_COLUMNS] on the device: param, grad, m codes, v codes, m meta, v meta pointers, groups,
        scalars row, remainder pointer (the param's again without remainders: never read). Rebuilt when any pointer
        moves (states too: offloading swaps them)."""
        remainder_column = columns[0] if remainders is None else remainders
        key = (tuple(t.data_ptr() for col in (*columns, remainder_column) for t in col), tuple(scalar_index))
        if key != self._table_key:
            n = len(self.layouts)
            ptrs = torch.tensor(key[0], dtype=torch.int64).view(len(columns) + 1, n)
            extra = torch.tensor([[lay.num_groups for lay in self.layouts], key[1]], dtype=torch.int64)
            self._table = torch.cat([ptrs[:-1], extra, ptrs[-1:]]).t().contiguous().to(self.device)
            streamed = key[0][:4 * n] + key[0][len(columns) * n:]  # param, grad, codes, remainders: vector loads
            self._aligned = self.rows_aligned and all(p % 16 == 0 for p in streamed)
            self._table_key = key
        return self._table

    def __call__(self, params, grads, m_codes, m_metas, v_codes, v_metas, scalars: list[AdamWScalars],
                 m_cfg: DREConfig, v_cfg: DREConfig, skipped: torch.Tensor, skip_nonfinite: bool = True,
                 remainders: list[torch.Tensor] | None = None) -> None:
        """Adds the number of skipped groups (non-finite new second moment) to `skipped` (int32 [1]). remainders:
        the bf16 params' master remainders (int16, one per element), stepped as their fp32 masters."""
        if remainders is not None and (params[0].dtype != torch.bfloat16 or any(
                r.dtype != torch.int16 or r.numel() != lay.numel or r.device != p.device or not r.is_contiguous()
                for r, p, lay in zip(remainders, params, self.layouts))):
            raise ValueError("master remainders belong to bf16 params: contiguous int16 tensors of each param's numel "
                             "on its device")
        unique: dict[AdamWScalars, int] = {}
        scalar_index = [unique.setdefault(h, len(unique)) for h in scalars]
        table = self._pointer_table((params, grads, m_codes, v_codes, m_metas, v_metas), scalar_index, remainders)
        pin = self.device.type == "cuda"
        consts = torch.tensor([[getattr(h, f) for f in AdamWScalars.__dataclass_fields__] for h in unique],
                              dtype=torch.float32, pin_memory=pin).to(self.device, non_blocking=True)
        kernel = fused_adamw_kernel()
        for rows, full in ((self.full_rows, True), (self.ragged_rows, False)):
            if len(rows):
                kernel[(len(rows),)](
                    rows, table, consts, skipped, m_cfg.fmt.log2_table(self.device),
                    v_cfg.fmt.log2_table(self.device),
                    P_DTYPE=_TRITON_DTYPES[params[0].dtype], G_DTYPE=_TRITON_DTYPES[grads[0].dtype],
                    **{f"M_{k}": v for k, v in _moment_args(m_cfg).items()},
                    **{f"V_{k}": v for k, v in _moment_args(v_cfg).items()},
                    SKIP_NONFINITE=skip_nonfinite, GROUP=self.group_size, NG=self.groups_per_row,
                    ALIGNED=self._aligned, FULL=full, THREADS_PER_GROUP=self.threads_per_group,
                    REMAINDER=remainders is not None,
                    enable_fp_fusion=False, num_warps=NUM_WARPS,
                    **({} if MAX_REGISTERS is None else dict(maxnreg=MAX_REGISTERS)),
                )
