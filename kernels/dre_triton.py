"""Triton kernels: FP8 group quantization with Dynamic Range Expansion, and the fused multi-tensor AdamW step.

Same math and operation order as `dre_reference.py` (IEEE div/sqrt, libdevice exp2/log2 on the GPU, FMA
contraction off), so GPU codes match the reference bit for bit. One program handles one row: up to
GROUPS_PER_ROW consecutive groups of one tensor (`GroupLayout.rows`); a launch covers many tensors through a
pointer table, with no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .dre_reference import R_EPS, AdamWScalars, DREConfig, f32
from .grouping import GroupLayout
from .triton_fp8 import INTERPRET, to_e4m3, to_e5m2

GROUPS_PER_ROW = 8
_ACCURATE = not INTERPRET  # libdevice exp2/log2 match torch's CUDA exp2f/log2f; the interpreter lacks libdevice
CONSTANT_RATIO: tl.constexpr = tl.constexpr(1.0 + R_EPS)  # R at or below this: k = 1


@triton.jit
def _exp2(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def _log2(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log2(x)
    else:
        return tl.log2(x)


@triton.jit
def _quantize_groups(x, mask, EXPAND: tl.constexpr, IS_E5M2: tl.constexpr, FP8_MAX: tl.constexpr,
                     EXPAND_NUM: tl.constexpr, EXPAND_MIN: tl.constexpr, K_MAX: tl.constexpr,
                     ACCURATE: tl.constexpr):
    """x fp32 [NG, G] -> (codes fp8 [NG, G], scale [NG], k [NG], center [NG])."""
    ax = tl.where(mask, tl.abs(x), 0.0)
    big = tl.max(ax, axis=1)
    small = tl.min(tl.where(ax > 0, ax, float("inf")), axis=1)
    nonzero = big > 0
    big_s = tl.where(nonzero, big, 1.0)
    small_s = tl.where(nonzero, small, 1.0)
    if EXPAND:
        ratio = tl.math.div_rn(big_s, small_s)
        k = tl.math.div_rn(tl.floor(tl.math.div_rn(EXPAND_NUM, _log2(ratio, ACCURATE))), EXPAND_MIN * 1.0)
        k = tl.minimum(tl.maximum(k, 1.0), K_MAX)
        k = tl.where((ratio <= CONSTANT_RATIO) | (big == 0), 1.0, k)
        center = tl.where(nonzero, tl.math.sqrt_rn(big_s) * tl.math.sqrt_rn(small_s), 1.0)
    else:
        k = tl.full(big.shape, 1.0, tl.float32)
        center = tl.full(big.shape, 1.0, tl.float32)
    unit = (k == 1.0)[:, None]
    t = tl.math.div_rn(ax, center[:, None])
    y = tl.where(unit, t, _exp2(k[:, None] * _log2(t, ACCURATE), ACCURATE))
    top = tl.math.div_rn(big_s, center)
    top = tl.where(k == 1.0, top, _exp2(k * _log2(top, ACCURATE), ACCURATE))
    scale = tl.where(nonzero, tl.math.div_rn(top, FP8_MAX), 0.0)
    yq = tl.math.div_rn(y, tl.where(nonzero, scale, 1.0)[:, None])
    yq = tl.where(x < 0, -yq, yq)
    if IS_E5M2:
        codes = to_e5m2(yq)
    else:
        codes = to_e4m3(yq)
    return codes, scale, k, center


@triton.jit
def _dequantize_groups(q, scale, k, center, ACCURATE: tl.constexpr):
    """q fp32 codes [NG, G] -> fp32 values."""
    u = tl.abs(q) * scale[:, None]
    xa = tl.where((k == 1.0)[:, None], u, _exp2(tl.math.div_rn(_log2(u, ACCURATE), k[:, None]), ACCURATE))
    xa = xa * center[:, None]
    return tl.where(q < 0, -xa, xa)


@triton.jit
def _ptr(table, col: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(table + col).to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _fused_adamw_kernel(
    rows, tensors, scalars, skipped,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    M_E5M2: tl.constexpr, M_EXPAND: tl.constexpr, M_MAX: tl.constexpr, M_NUM: tl.constexpr,
    M_EMIN: tl.constexpr, M_KMAX: tl.constexpr,
    V_E5M2: tl.constexpr, V_EXPAND: tl.constexpr, V_MAX: tl.constexpr, V_NUM: tl.constexpr,
    V_EMIN: tl.constexpr, V_KMAX: tl.constexpr, SKIP_NONFINITE: tl.constexpr,
    GROUP: tl.constexpr, NG: tl.constexpr, ALIGNED: tl.constexpr, ACCURATE: tl.constexpr,
):
    row = rows + tl.program_id(0) * 4
    t = tl.load(row)
    start = tl.load(row + 1)
    numel = tl.load(row + 2)
    first_group = tl.load(row + 3)
    if ALIGNED:
        start = tl.multiple_of(start, 16)
    tab = tensors + t * 8
    p_ptr = _ptr(tab, 0, P_DTYPE, ALIGNED)
    g_ptr = _ptr(tab, 1, G_DTYPE, ALIGNED)
    mq_ptr = _ptr(tab, 2, tl.uint8, ALIGNED)
    vq_ptr = _ptr(tab, 3, tl.uint8, ALIGNED)
    m_meta = _ptr(tab, 4, tl.float32, False)
    v_meta = _ptr(tab, 5, tl.float32, False)
    n_groups = tl.load(tab + 6)
    sc = scalars + t * 8
    decay = tl.load(sc)
    step_size = tl.load(sc + 1)
    bc2_sqrt = tl.load(sc + 2)
    eps = tl.load(sc + 3)
    beta1 = tl.load(sc + 4)
    one_minus_beta1 = tl.load(sc + 5)
    beta2 = tl.load(sc + 6)
    one_minus_beta2 = tl.load(sc + 7)

    local = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = local < numel
    offs = start + local
    gid = first_group + tl.arange(0, NG)
    gmask = tl.arange(0, NG) * GROUP < numel

    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if M_E5M2:
        mq = tl.load(mq_ptr + offs, mask=mask, other=0).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        mq = tl.load(mq_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if V_E5M2:
        vq = tl.load(vq_ptr + offs, mask=mask, other=0).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        vq = tl.load(vq_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    m_scale = tl.load(m_meta + gid, mask=gmask, other=0.0)
    m_k = tl.load(m_meta + n_groups + gid, mask=gmask, other=1.0)
    m_c = tl.load(m_meta + 2 * n_groups + gid, mask=gmask, other=1.0)
    v_scale = tl.load(v_meta + gid, mask=gmask, other=0.0)
    v_k = tl.load(v_meta + n_groups + gid, mask=gmask, other=1.0)
    v_c = tl.load(v_meta + 2 * n_groups + gid, mask=gmask, other=1.0)

    m = _dequantize_groups(mq, m_scale, m_k, m_c, ACCURATE)
    v = _dequantize_groups(vq, v_scale, v_k, v_c, ACCURATE)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    p = p * decay
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)

    m_codes, m_scale, m_k, m_c = _quantize_groups(m, mask, M_EXPAND, M_E5M2, M_MAX, M_NUM, M_EMIN, M_KMAX,
                                                  ACCURATE)
    v_codes, v_scale, v_k, v_c = _quantize_groups(v, mask, V_EXPAND, V_E5M2, V_MAX, V_NUM, V_EMIN, V_KMAX,
                                                  ACCURATE)
    if SKIP_NONFINITE:
        finite = (g == g) & (tl.abs(g) != float("inf"))
        bad = tl.max(tl.where(mask & ~finite, 1, 0), axis=1) > 0
        n_bad = tl.sum(bad.to(tl.int32), axis=0)
        tl.atomic_add(skipped, n_bad, mask=n_bad > 0)
        gmask = gmask & ~bad
        mask = mask & ~bad[:, None]
    tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
    tl.store(mq_ptr + offs, m_codes.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(vq_ptr + offs, v_codes.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(m_meta + gid, m_scale, mask=gmask)
    tl.store(m_meta + n_groups + gid, m_k, mask=gmask)
    tl.store(m_meta + 2 * n_groups + gid, m_c, mask=gmask)
    tl.store(v_meta + gid, v_scale, mask=gmask)
    tl.store(v_meta + n_groups + gid, v_k, mask=gmask)
    tl.store(v_meta + 2 * n_groups + gid, v_c, mask=gmask)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, meta, rows, n_groups, E5M2: tl.constexpr, EXPAND: tl.constexpr,
                     MAX: tl.constexpr, NUM: tl.constexpr, EMIN: tl.constexpr, KMAX: tl.constexpr,
                     GROUP: tl.constexpr, NG: tl.constexpr, ACCURATE: tl.constexpr):
    row = rows + tl.program_id(0) * 3
    start = tl.load(row)
    numel = tl.load(row + 1)
    first_group = tl.load(row + 2)
    local = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = local < numel
    gid = first_group + tl.arange(0, NG)
    gmask = tl.arange(0, NG) * GROUP < numel
    x = tl.load(x_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    codes, scale, k, center = _quantize_groups(x, mask, EXPAND, E5M2, MAX, NUM, EMIN, KMAX, ACCURATE)
    tl.store(codes_ptr + start + local, codes.to(tl.uint8, bitcast=True), mask=mask)
    tl.store(meta + gid, scale, mask=gmask)
    tl.store(meta + n_groups + gid, k, mask=gmask)
    tl.store(meta + 2 * n_groups + gid, center, mask=gmask)


@triton.jit
def _dequantize_kernel(codes_ptr, meta, out_ptr, rows, n_groups, IS_E5M2: tl.constexpr, GROUP: tl.constexpr,
                       NG: tl.constexpr, ACCURATE: tl.constexpr):
    row = rows + tl.program_id(0) * 3
    start = tl.load(row)
    numel = tl.load(row + 1)
    first_group = tl.load(row + 2)
    local = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = local < numel
    gid = first_group + tl.arange(0, NG)
    gmask = tl.arange(0, NG) * GROUP < numel
    raw = tl.load(codes_ptr + start + local, mask=mask, other=0)
    if IS_E5M2:
        q = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        q = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = tl.load(meta + gid, mask=gmask, other=0.0)
    k = tl.load(meta + n_groups + gid, mask=gmask, other=1.0)
    center = tl.load(meta + 2 * n_groups + gid, mask=gmask, other=1.0)
    tl.store(out_ptr + start + local, _dequantize_groups(q, scale, k, center, ACCURATE), mask=mask)


def _moment_args(cfg: DREConfig):
    return dict(E5M2=cfg.fmt.name == "e5m2", EXPAND=cfg.expand, MAX=cfg.fmt.max, NUM=cfg.expand_numerator,
                EMIN=cfg.expand_min, KMAX=f32(cfg.k_max))


def quantize(x: torch.Tensor, layout: GroupLayout, cfg: DREConfig):
    """Triton twin of `dre_reference.quantize`."""
    codes = torch.zeros(layout.numel, dtype=cfg.fmt.dtype, device=x.device)
    meta = torch.empty(3, layout.num_groups, dtype=torch.float32, device=x.device)
    rows = layout.rows(GROUPS_PER_ROW).to(x.device)
    if len(rows):
        _quantize_kernel[(len(rows),)](x.contiguous().view(-1), codes.view(torch.uint8), meta, rows,
                                       layout.num_groups, GROUP=layout.group_size, NG=GROUPS_PER_ROW,
                                       ACCURATE=_ACCURATE, enable_fp_fusion=False, **_moment_args(cfg))
    return codes, meta


def dequantize(codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """Triton twin of `dre_reference.dequantize`."""
    out = torch.zeros(layout.numel, dtype=torch.float32, device=codes.device)
    rows = layout.rows(GROUPS_PER_ROW).to(codes.device)
    if len(rows):
        _dequantize_kernel[(len(rows),)](codes.view(torch.uint8), meta, out, rows, layout.num_groups,
                                         IS_E5M2=codes.dtype == torch.float8_e5m2, GROUP=layout.group_size,
                                         NG=GROUPS_PER_ROW, ACCURATE=_ACCURATE, enable_fp_fusion=False)
    return out


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def rows_for(layouts: list[GroupLayout]) -> torch.Tensor:
    """Rows of a multi-tensor launch, int64 [R, 4]: (tensor index, flat_start, numel, first_group)."""
    parts = []
    for i, layout in enumerate(layouts):
        r = layout.rows(GROUPS_PER_ROW)
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
        rows, tensors, consts, skipped,
        P_DTYPE=_TRITON_DTYPES[params[0].dtype], G_DTYPE=_TRITON_DTYPES[grads[0].dtype],
        **{f"M_{k}": v for k, v in _moment_args(m_cfg).items()}, **{f"V_{k}": v for k, v in _moment_args(v_cfg).items()},
        SKIP_NONFINITE=skip_nonfinite,
        GROUP=layouts[0].group_size, NG=GROUPS_PER_ROW, ALIGNED=aligned, ACCURATE=_ACCURATE,
        enable_fp_fusion=False, num_warps=4,
    )
