"""CoatFP8Muon's momentum step as one Triton kernel: per row of quantization groups, dequantize the FP8 momentum,
m = lerp(m, g, 1 - momentum), write the update Newton-Schulz starts from (lerp(g, m, momentum) with Nesterov, else
m) in fp32, and re-quantize m with Dynamic Range Expansion in place. One pass over the codes and the gradient instead
of dequantize, two torch lerps and quantize, each a pass of its own over fp32 buffers.

The lerps are torch's (ATen's `lerp`, a single fused multiply-add after one subtraction, as the CPU's vectorized
kernel and nvcc's contraction of the CUDA kernel compute it): for a weight w below 0.5, fma(w, end - self, self),
else fma(w - 1, end - self, end), with w the weight rounded to fp32. The momentum's (de)quantization is dre_triton's
group decoder and encoder. A matrix whose gradient holds NaN/Inf (`finite` False) keeps its codes and metadata: the
whole matrix is skipped, as Newton-Schulz mixes all of it. One launch per matrix, no host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..portable_math import fma_p
from ..triton_fp8 import nanmax
from .dre_reference import DREConfig, f32
from .dre_triton import TILE_GROUPS, _decode_group_tile, _encode_group_tile, _moment_args, _row_tile
from .grouping import GroupLayout


@triton.jit
def _lerp(start, end, weight, weight_minus_one, SMALL: tl.constexpr):
    if SMALL:
        return fma_p(weight, end - start, start)
    return fma_p(weight_minus_one, end - start, end)


@triton.jit
def _muon_momentum_kernel(g_ptr, codes_ptr, meta, rows, n_groups, log2_table, update_ptr, finite_ptr,
                          w_m, w_m_minus_one, w_u, w_u_minus_one, SMALL_M: tl.constexpr, SMALL_U: tl.constexpr,
                          NESTEROV: tl.constexpr, E5M2: tl.constexpr, EXPAND: tl.constexpr, LOG2_MAX: tl.constexpr,
                          NUM: tl.constexpr, INV_EMIN: tl.constexpr, KMAX: tl.constexpr, KEEP_NONZERO: tl.constexpr,
                          MIN_SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr):
    start, local, mask, gid, gmask = _row_tile(rows + tl.program_id(0) * 3, GROUP, NG)
    g = tl.load(g_ptr + start + local, mask=mask, other=0.0).to(tl.float32)
    m = _decode_group_tile(tl.load(codes_ptr + start + local, mask=mask, other=0), meta, n_groups, gid, gmask,
                           log2_table, LOG2_MAX)
    m = _lerp(m, g, w_m, w_m_minus_one, SMALL_M)
    if NESTEROV:
        update = _lerp(g, m, w_u, w_u_minus_one, SMALL_U)
    else:
        update = m
    tl.store(update_ptr + start + local, update, mask=mask)
    finite = tl.load(finite_ptr) != 0
    mask = mask & finite
    gmask = gmask & finite
    m_abs = tl.where(mask, tl.abs(m), 0.0)
    big = tl.reduce(m_abs, 1, nanmax)
    _encode_group_tile(m, m_abs, big, mask, codes_ptr + start + local, meta, n_groups, gid, gmask, E5M2, EXPAND,
                       LOG2_MAX, NUM, INV_EMIN, KMAX, KEEP_NONZERO, MIN_SUB)


def momentum_step(grad: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, layout: GroupLayout, momentum: float,
                  nesterov: bool, finite: torch.Tensor, cfg: DREConfig,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 update (grad's shape) Newton-Schulz starts from; the FP8 momentum (codes, meta) stepped in place
    unless `finite` (a 0-dim bool tensor on the device) is False. rows: the layout's `rows(TILE_GROUPS)` on the device
    (made here when not given; callers keep them per layout)."""
    if grad.numel() != layout.numel:
        raise ValueError(f"gradient of {grad.numel()} elements for a momentum layout of {layout.numel}")
    update = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    if rows is None:
        rows = layout.rows(TILE_GROUPS).to(grad.device)
    if not len(rows):
        return update
    w_m, w_u = f32(1 - momentum), f32(momentum)
    _muon_momentum_kernel[(len(rows),)](
        grad.reshape(-1), codes.view(torch.uint8), meta, rows, layout.num_groups, cfg.fmt.log2_table(grad.device),
        update.view(-1), finite.reshape(1).to(torch.uint8), w_m, f32(w_m - 1), w_u, f32(w_u - 1),
        SMALL_M=abs(w_m) < 0.5, SMALL_U=abs(w_u) < 0.5, NESTEROV=nesterov, GROUP=layout.group_size, NG=TILE_GROUPS,
        enable_fp_fusion=False, **_moment_args(cfg))
    return update
