"""CoatFP8Muon's step around Newton-Schulz as two Triton kernels.

`momentum_step`: per row of quantization groups, dequantize the FP8 momentum, m = lerp(m, g, 1 - momentum), write
the update Newton-Schulz starts from (lerp(g, m, momentum) with Nesterov, else m) rounded to bf16 (Newton-Schulz's
first operation, `update.bfloat16()`), and re-quantize m with Dynamic Range Expansion in place. One pass over the
codes and the gradient instead of dequantize, two torch lerps and quantize, each a pass of its own over fp32 buffers.

`apply_update_`: p = p (1 - lr wd) - lr' O with O the orthogonalised update, torch.optim.Muon's `p.mul_(...)` and
`p.add_(O, alpha=-lr')` in one pass (torch's arithmetic: the product rounded to p's dtype, then one fused
multiply-add), writing nothing when the matrix's gradient was not finite.

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

from ..portable_math import fma_p, to_bf16_p, to_dtype_p
from ..triton_fp8 import nanmax
from .dre_reference import DREConfig, f32
from .dre_triton import TILE_GROUPS, _TRITON_DTYPES, _decode_group_tile, _encode_group_tile, _moment_args, _row_tile
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
    tl.store(update_ptr + start + local, to_bf16_p(update), mask=mask)
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
    """The bf16 update (grad's shape) Newton-Schulz starts from; the FP8 momentum (codes, meta) stepped in place
    unless `finite` (a 0-dim bool tensor on the device) is False. rows: the layout's `rows(TILE_GROUPS)` on the device
    (made here when not given; callers keep them per layout)."""
    if grad.numel() != layout.numel:
        raise ValueError(f"gradient of {grad.numel()} elements for a momentum layout of {layout.numel}")
    update = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
    if rows is None:
        rows = layout.rows(TILE_GROUPS).to(grad.device)
    if not len(rows):
        return update
    w_m, w_u = f32(1 - momentum), f32(momentum)
    _muon_momentum_kernel[(len(rows),)](
        grad.reshape(-1), codes.view(torch.uint8), meta, rows, layout.num_groups, cfg.fmt.log2_table(grad.device),
        update.view(-1), finite.reshape(1).view(torch.uint8), w_m, f32(w_m - 1), w_u, f32(w_u - 1),
        SMALL_M=abs(w_m) < 0.5, SMALL_U=abs(w_u) < 0.5, NESTEROV=nesterov, GROUP=layout.group_size, NG=TILE_GROUPS,
        enable_fp_fusion=False, **_moment_args(cfg))
    return update


@triton.jit
def _apply_update_kernel(p_ptr, u_ptr, finite_ptr, rows, cols, sp0, sp1, su0, su1, decay, alpha,
                         P_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)[None, :]
    mask = (r < rows) & (c < cols) & (tl.load(finite_ptr) != 0)
    p = tl.load(p_ptr + r * sp0 + c * sp1, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * su0 + c * su1, mask=mask, other=0.0).to(tl.float32)
    decayed = to_dtype_p(p * decay, P_DTYPE).to(tl.float32)
    tl.store(p_ptr + r * sp0 + c * sp1, to_dtype_p(fma_p(alpha, u, decayed), P_DTYPE), mask=mask)


APPLY_BLOCK = 64  # rows and columns per program of apply_update_


def apply_update_(p: torch.Tensor, orthogonal: torch.Tensor, decay: float, lr: float, finite: torch.Tensor) -> None:
    """p = p * decay - lr * orthogonal in place (2-D, any strides; orthogonal in bf16, as Newton-Schulz returns it),
    as `p.mul_(decay).add_(orthogonal, alpha=-lr)` computes it, unless `finite` (0-dim bool on the device) is
    False."""
    if p.dim() != 2 or orthogonal.shape != p.shape:
        raise ValueError(f"update of shape {tuple(orthogonal.shape)} for a parameter of shape {tuple(p.shape)}")
    if p.dtype not in _TRITON_DTYPES:
        raise TypeError(f"parameters in {p.dtype} are not supported (float32, bfloat16, float16)")
    rows, cols = p.shape
    if not rows or not cols:
        return
    grid = (-(-rows // APPLY_BLOCK), -(-cols // APPLY_BLOCK))
    _apply_update_kernel[grid](p, orthogonal, finite.reshape(1).view(torch.uint8), rows, cols, *p.stride(),
                               *orthogonal.stride(), f32(decay), f32(-lr), P_DTYPE=_TRITON_DTYPES[p.dtype],
                               BLOCK_R=APPLY_BLOCK, BLOCK_C=APPLY_BLOCK, enable_fp_fusion=False)
