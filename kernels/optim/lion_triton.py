"""The fused COAT Lion step as a Triton kernel: per row of quantization groups, dequantize the FP8 momentum, Lion,
re-quantize with Dynamic Range Expansion. The operations and their order are lion_reference.fused_lion_step's (IEEE
division, portable_math's log2/exp2/fma, no other FMA contraction), on dre_triton's group decoder and encoder: the
same bits on the GPU (under TRITON_INTERPRET the fp32->fp8 casts round differently: compare with a tolerance there).
One launch per tensor, no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..portable_math import fma_p
from ..triton_fp8 import nanmax
from .dre_reference import DREConfig
from .dre_triton import TILE_GROUPS, _TRITON_DTYPES, _decode_group_tile, _encode_group_tile, _moment_args, _row_tile
from .grouping import GroupLayout
from .lion_reference import LionScalars


@triton.jit
def _fused_lion_kernel(p_ptr, g_ptr, codes_ptr, meta, rows, n_groups, skipped, log2_table,
                       decay, lr, beta1, one_minus_beta1, beta2, one_minus_beta2,
                       P_DTYPE: tl.constexpr, E5M2: tl.constexpr, EXPAND: tl.constexpr, LOG2_MAX: tl.constexpr,
                       NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr, KEEP_NONZERO: tl.constexpr,
                       MIN_SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    p = tl.load(p_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    m = _decode_group_tile(tl.load(codes_ptr + start + local, mask=mask, other=0), meta, n_groups, gid, gmask,
                           log2_table, LOG2_MAX)
    c = fma_p(m, beta1, g * one_minus_beta1)
    direction = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    p = fma_p(-lr, direction, p * decay)
    m = fma_p(m, beta2, g * one_minus_beta2)
    m_abs = tl.where(mask, tl.abs(m), 0.0)
    big = tl.reduce(m_abs, 1, nanmax)
    bad = ~(big < float("inf"))  # groups whose new momentum is NaN/Inf keep everything
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    tl.atomic_add(skipped, n_bad, mask=n_bad > 0)
    gmask = gmask & ~bad
    mask = mask & ~bad[:, None]
    tl.store(p_ptr + start + local, p.to(P_DTYPE), mask=mask)
    _encode_group_tile(m, m_abs, big, mask, codes_ptr + start + local, meta, n_groups, gid, gmask, E5M2, EXPAND,
                       LOG2_MAX, NUM, INV_EMIN, KMAX, KEEP_NONZERO, MIN_SUB)


def fused_lion_step(param, grad, codes, meta, layout: GroupLayout, h: LionScalars, cfg: DREConfig,
                    skipped: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """lion_reference.fused_lion_step on the kernel; adds the skipped groups to `skipped` (int32 [1]). rows: the
    layout's `rows(TILE_GROUPS)` on the device (made here when not given; callers keep them per layout)."""
    if rows is None:
        rows = layout.rows(TILE_GROUPS).to(param.device)
    if not len(rows):
        return
    _fused_lion_kernel[(len(rows),)](
        param.view(-1), grad.reshape(-1), codes.view(torch.uint8), meta, rows, layout.num_groups, skipped,
        cfg.fmt.log2_table(param.device), h.decay, h.lr, h.beta1, h.one_minus_beta1, h.beta2, h.one_minus_beta2,
        P_DTYPE=_TRITON_DTYPES[param.dtype], GROUP=layout.group_size, NG=TILE_GROUPS, enable_fp_fusion=False,
        **_moment_args(cfg))
