"""Triton kernels: FP8 group quantization with Dynamic Range Expansion, and the fused multi-tensor AdamW step.

Same math and operation order as `dre_reference.py` (IEEE div/sqrt, portable_math's log2/exp2, FMA contraction
off), so codes match the reference bit for bit on the GPU and under TRITON_INTERPRET.

One program handles a tile [groups, 128] of one run (`GroupLayout.rows`); a launch covers many tensors through a
pointer table, with no host synchronisation. Tried and measured slower on the H100 (BENCHMARKS.md): a thread per
group (3x, strided loads do not coalesce), more groups or warps per program, a persistent grid (+17%).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dre_reference import LOG2_RATIO_EPS, AdamWScalars, DREConfig, f32
from .formats import get_format
from .grouping import GroupLayout
from .portable_math import exp2_p, log2_p
from .triton_fp8 import to_e4m3, to_e5m2

GROUPS_PER_PROGRAM = 1  # fused AdamW tile [groups, 128]: 1 group x 1 warp was the fastest on the H100
NUM_WARPS = 1
TILE_GROUPS = 8  # standalone quantize/dequantize: groups per program
LOG2_RATIO_EPS_C: tl.constexpr = tl.constexpr(LOG2_RATIO_EPS)


@triton.jit
def _group_params(big, small, EXPAND: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr):
    """See dre_reference.group_params: (k, log2 center, log2(scale * Q)) per group."""
    one = tl.full(big.shape, 1.0, tl.float32)
    nonzero = big > 0
    log2_big = log2_p(tl.where(nonzero, big, 1.0))
    log2_small = log2_p(tl.where(nonzero, small, 1.0))
    if EXPAND:
        log2_ratio = log2_big - log2_small
        k = tl.floor(tl.math.div_rn(one * NUM, log2_ratio)) * INV_EMIN
        k = tl.where(log2_ratio <= LOG2_RATIO_EPS_C, 1.0, tl.minimum(tl.maximum(k, 1.0), KMAX))
        log2_center = (log2_big + log2_small) * 0.5
    else:
        k = one
        log2_center = one * 0.0
    return k, log2_center, k * (log2_big - log2_center)


@triton.jit
def _encode(x, k, log2_center, log2_scale_q, E5M2: tl.constexpr, LOG2_MAX: tl.constexpr):
    """FP8 codes of x given its group's metadata (already broadcast to x's shape); see dre_reference.encode."""
    offset = log2_scale_q - LOG2_MAX + k * log2_center
    y = exp2_p(k * log2_p(tl.abs(x)) - offset)
    y = tl.where(x < 0, -y, y)
    if E5M2:
        return to_e5m2(y)
    else:
        return to_e4m3(y)


@triton.jit
def _decode(raw, log2_table, inv_k, bias):
    """fp32 values of uint8 codes, given per-group 1/k and bias (broadcast); see dre_reference.decode."""
    xa = exp2_p(tl.load(log2_table + (raw & 0x7F)) * inv_k + bias)
    return tl.where(raw >= 128, -xa, xa)


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
def _fused_adamw_kernel(
    rows, tensors, scalars, skipped, m_table, v_table,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    M_E5M2: tl.constexpr, M_EXPAND: tl.constexpr, M_LOG2_MAX: tl.constexpr, M_NUM: tl.constexpr,
    M_INV_EMIN: tl.constexpr, M_KMAX: tl.constexpr,
    V_E5M2: tl.constexpr, V_EXPAND: tl.constexpr, V_LOG2_MAX: tl.constexpr, V_NUM: tl.constexpr,
    V_INV_EMIN: tl.constexpr, V_KMAX: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, ALIGNED: tl.constexpr,
):
    row = rows + tl.program_id(0) * 4
    t = tl.load(row)
    start, local, mask, gid, gmask = _row_tile(row + 1, GROUP, NG)
    if ALIGNED:
        start = tl.multiple_of(start, 16)
    tab = tensors + t * 8
    p_ptr = _ptr(tab, 0, P_DTYPE, ALIGNED) + start
    g_ptr = _ptr(tab, 1, G_DTYPE, ALIGNED) + start
    mq_ptr = _ptr(tab, 2, tl.uint8, ALIGNED) + start
    vq_ptr = _ptr(tab, 3, tl.uint8, ALIGNED) + start
    m_meta = _ptr(tab, 4, tl.float32, False)
    v_meta = _ptr(tab, 5, tl.float32, False)
    n_groups = tl.load(tab + 6)
    sc = scalars + t * 8  # AdamWScalars, in field order
    decay = tl.load(sc)
    step_size = tl.load(sc + 1)
    inv_bc2_sqrt = tl.load(sc + 2)
    eps = tl.load(sc + 3)
    beta1 = tl.load(sc + 4)
    one_minus_beta1 = tl.load(sc + 5)
    beta2 = tl.load(sc + 6)
    one_minus_beta2 = tl.load(sc + 7)

    p = tl.load(p_ptr + local, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + local, mask=mask, other=0.0).to(tl.float32)
    m = _decode_group_tile(tl.load(mq_ptr + local, mask=mask, other=0), m_meta, n_groups, gid, gmask, m_table,
                           M_LOG2_MAX)
    v = _decode_group_tile(tl.load(vq_ptr + local, mask=mask, other=0), v_meta, n_groups, gid, gmask, v_table,
                           V_LOG2_MAX)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    p = p * decay
    denom = tl.math.sqrt_rn(v) * inv_bc2_sqrt + eps
    p = p - step_size * tl.math.div_rn(m, denom)

    if SKIP_NONFINITE:  # groups with NaN/Inf gradients keep everything
        finite = (g == g) & (tl.abs(g) != float("inf"))
        bad = tl.max(tl.where(mask & ~finite, 1, 0), axis=1) > 0
        n_bad = tl.sum(bad.to(tl.int32), axis=0)
        tl.atomic_add(skipped, n_bad, mask=n_bad > 0)
        gmask = gmask & ~bad
        mask = mask & ~bad[:, None]
    tl.store(p_ptr + local, p.to(P_DTYPE), mask=mask)
    _encode_group_tile(m, mask, mq_ptr + local, m_meta, n_groups, gid, gmask, M_E5M2, M_EXPAND, M_LOG2_MAX, M_NUM,
                       M_INV_EMIN, M_KMAX)
    _encode_group_tile(v, mask, vq_ptr + local, v_meta, n_groups, gid, gmask, V_E5M2, V_EXPAND, V_LOG2_MAX, V_NUM,
                       V_INV_EMIN, V_KMAX)


@triton.jit
def _decode_group_tile(raw, meta, n_groups, gid, gmask, log2_table, LOG2_MAX: tl.constexpr):
    """Codes [NG, GROUP] of groups `gid` -> fp32 values."""
    k, log2_center, log2_scale_q = _load_meta(meta, n_groups, gid, gmask)
    inv_k = tl.math.div_rn(tl.full(k.shape, 1.0, tl.float32), k)
    bias = (log2_scale_q - LOG2_MAX) * inv_k + log2_center
    return _decode(raw, log2_table, inv_k[:, None], bias[:, None])


@triton.jit
def _encode_group_tile(x, mask, codes_ptrs, meta, n_groups, gid, gmask, E5M2: tl.constexpr, EXPAND: tl.constexpr,
                       LOG2_MAX: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr):
    """Quantize fp32 [NG, GROUP] groupwise: store codes where `mask`, and the metadata where `gmask`."""
    ax = tl.where(mask, tl.abs(x), 0.0)
    big = tl.max(ax, axis=1)
    small = tl.min(tl.where(ax > 0, ax, float("inf")), axis=1)
    k, log2_center, log2_scale_q = _group_params(big, small, EXPAND, NUM, INV_EMIN, KMAX)
    codes = _encode(x, k[:, None], log2_center[:, None], log2_scale_q[:, None], E5M2, LOG2_MAX)
    tl.store(codes_ptrs, codes.to(tl.uint8, bitcast=True), mask=mask)
    _store_meta(meta, n_groups, gid, gmask, k, log2_center, log2_scale_q)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, meta, rows, n_groups, E5M2: tl.constexpr, EXPAND: tl.constexpr,
                     LOG2_MAX: tl.constexpr, NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr,
                     GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    x = tl.load(x_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    _encode_group_tile(x, mask, codes_ptr + start + local, meta, n_groups, gid, gmask, E5M2, EXPAND, LOG2_MAX,
                       NUM, INV_EMIN, KMAX)


@triton.jit
def _dequantize_kernel(codes_ptr, meta, out_ptr, rows, n_groups, log2_table, LOG2_MAX: tl.constexpr,
                       GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    raw = tl.load(codes_ptr + start + local, mask=mask, other=0)
    x = _decode_group_tile(raw, meta, n_groups, gid, gmask, log2_table, LOG2_MAX)
    tl.store(out_ptr + start + local, x, mask=mask)


def _moment_args(cfg: DREConfig):
    return dict(E5M2=cfg.fmt.name == "e5m2", EXPAND=cfg.expand, LOG2_MAX=cfg.log2_max, NUM=cfg.expand_numerator,
                INV_EMIN=cfg.inv_expand_min, KMAX=f32(cfg.k_max))


def quantize(x: torch.Tensor, layout: GroupLayout, cfg: DREConfig):
    """Triton twin of `dre_reference.quantize`."""
    codes = torch.zeros(layout.numel, dtype=cfg.fmt.dtype, device=x.device)
    meta = torch.empty(3, layout.num_groups, dtype=torch.float32, device=x.device)
    rows = layout.rows(TILE_GROUPS).to(x.device)
    if len(rows):
        _quantize_kernel[(len(rows),)](x.contiguous().view(-1), codes.view(torch.uint8), meta, rows,
                                       layout.num_groups, GROUP=layout.group_size, NG=TILE_GROUPS,
                                       enable_fp_fusion=False, **_moment_args(cfg))
    return codes, meta


def dequantize(codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """Triton twin of `dre_reference.dequantize`."""
    out = torch.zeros(layout.numel, dtype=torch.float32, device=codes.device)
    rows = layout.rows(TILE_GROUPS).to(codes.device)
    fmt = get_format(codes.dtype)
    if len(rows):
        _dequantize_kernel[(len(rows),)](codes.view(torch.uint8), meta, out, rows, layout.num_groups,
                                         fmt.log2_table(codes.device), LOG2_MAX=fmt.log2_max,
                                         GROUP=layout.group_size, NG=TILE_GROUPS, enable_fp_fusion=False)
    return out


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rows_for(layouts: list[GroupLayout]) -> torch.Tensor:
    """Rows of a multi-tensor launch, int64 [R, 4]: (tensor index, flat_start, numel, first_group)."""
    parts = []
    for i, layout in enumerate(layouts):
        r = layout.rows(GROUPS_PER_PROGRAM)
        parts.append(torch.cat([torch.full((len(r), 1), i, dtype=torch.int64), r], dim=1))
    return torch.cat(parts) if parts else torch.zeros(0, 4, dtype=torch.int64)


def fused_adamw(rows: torch.Tensor, rows_aligned: bool, params, grads, m_codes, m_metas, v_codes, v_metas,
                layouts: list[GroupLayout], scalars: list[AdamWScalars], m_cfg: DREConfig, v_cfg: DREConfig,
                skipped: torch.Tensor, skip_nonfinite: bool = True) -> None:
    """One launch for many tensors of one (param dtype, grad dtype). `rows` comes from `rows_for(layouts)`,
    already on the device. Adds the number of skipped (non-finite gradient) groups to `skipped` (int32 [1])."""
    if not len(rows):
        return
    device = params[0].device
    table = [[p.data_ptr(), g.data_ptr(), mq.data_ptr(), vq.data_ptr(), mm.data_ptr(), vm.data_ptr(),
              lay.num_groups, 0]
             for p, g, mq, vq, mm, vm, lay in zip(params, grads, m_codes, v_codes, m_metas, v_metas, layouts)]
    aligned = rows_aligned and all(ptr % 16 == 0 for row in table for ptr in row[:4])
    pin = device.type == "cuda"
    tensors = torch.tensor(table, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
    consts = torch.tensor([[getattr(h, f) for f in AdamWScalars.__dataclass_fields__] for h in scalars],
                          dtype=torch.float32, pin_memory=pin).to(device, non_blocking=True)
    _fused_adamw_kernel[(len(rows),)](
        rows, tensors, consts, skipped, m_cfg.fmt.log2_table(device), v_cfg.fmt.log2_table(device),
        P_DTYPE=_TRITON_DTYPES[params[0].dtype], G_DTYPE=_TRITON_DTYPES[grads[0].dtype],
        **{f"M_{k}": v for k, v in _moment_args(m_cfg).items()}, **{f"V_{k}": v for k, v in _moment_args(v_cfg).items()},
        SKIP_NONFINITE=skip_nonfinite, GROUP=layouts[0].group_size, NG=GROUPS_PER_PROGRAM, ALIGNED=aligned,
        enable_fp_fusion=False, num_warps=NUM_WARPS,
    )
